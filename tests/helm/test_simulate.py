"""The placement simulation behind deploy/README.md's plan runs and reports what it claims."""

from __future__ import annotations

import json

from pdserve.bench.placement import main


def test_simulation_prints_one_json_object(capsys):
    assert main(["--prefill", "6", "--decode", "10", "--requests", "60", "--routers", "1,2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["attainment_by_routers"]) == {"1", "2"}
    for attainment in result["attainment_by_routers"].values():
        assert set(attainment) == {"round_robin", "least_loaded", "slo_aware", "oracle"}
        assert all(0 <= a <= 1 for a in attainment.values())
    assert set(result["by_routers"]["2"]) == {"round_robin", "least_loaded", "slo_aware"}
    for policy in result["by_routers"]["2"].values():
        assert 0 <= policy["slo_attainment"] <= 1 and 0 < policy["oracle_slo_attainment"] <= 1
        assert policy["decision_ms"]["p50"] > 0
        assert policy["ttft_s"]["p50"] > 0 and policy["tpot_s"]["p50"] > 0


def test_oracle_matches_slo_aware_with_exact_views(capsys):
    """One router polling before every request sees the exact state: slo_aware is then the oracle."""
    main(["--prefill", "6", "--decode", "10", "--requests", "40", "--routers", "1", "--poll-s", "0",
          "--policies", "slo_aware", "--choice-tolerance", "0"])
    result = json.loads(capsys.readouterr().out)["by_routers"]["1"]["slo_aware"]
    assert result["ttft_regret_s"]["p99"] == 0 and result["tpot_regret_s"]["p99"] == 0


def test_router_counts_that_cannot_work_are_refused(capsys):
    for bad in ("0", "two", "1,-2"):
        try:
            main(["--routers", bad])
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"--routers {bad} was accepted")
    assert "--routers" in capsys.readouterr().err


def test_routers_with_instant_placement_sync_place_as_one_router(capsys):
    """With every placement heard at once (and no random choice), 8 routers hold one shared view and place
    about as 1 router does (their policies' seeds still break ties differently). Without sync the same 8
    routers herd: slower first tokens and missed SLOs."""
    base = ["--prefill", "6", "--decode", "10", "--requests", "200", "--rate", "400", "--policies", "slo_aware",
            "--choice-tolerance", "0"]

    def run(*extra: str) -> dict:
        main([*base, *extra])
        return json.loads(capsys.readouterr().out)["by_routers"]

    one = run("--routers", "1")["1"]["slo_aware"]
    synced = run("--routers", "8", "--sync-delay-s", "0")["8"]["slo_aware"]
    alone = run("--routers", "8")["8"]["slo_aware"]
    assert synced["slo_attainment"] == one["slo_attainment"]
    assert abs(synced["ttft_s"]["mean"] / one["ttft_s"]["mean"] - 1) < 0.1
    assert alone["ttft_s"]["mean"] > 1.5 * one["ttft_s"]["mean"] and alone["slo_attainment"] < one["slo_attainment"]


def test_a_negative_sync_delay_is_refused(capsys):
    try:
        main(["--sync-delay-s", "-0.001"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("a negative --sync-delay-s was accepted")
    assert "--sync-delay-s" in capsys.readouterr().err
