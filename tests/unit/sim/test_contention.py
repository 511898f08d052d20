"""Over-subscribed cores: the simulator's measured slow-down beyond a fair share
(`ClusterSpec.oversubscribed_scale`), and the probe that measures it (pdserve.loadtest.contention)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdserve.loadtest.cli import main as loadtest_main
from pdserve.loadtest.contention import engines_per_host, for_scenario, measure
from pdserve.sim.cluster import Simulation
from pdserve.sim.config import ClusterSpec, SimRequest

REPO = Path(__file__).resolve().parents[3]


def _slowest_ttft(profile, num_cores: float, scale: tuple[float, float]) -> float:
    spec = ClusterSpec(mode="colocated", num_decode=3, num_cores=num_cores, oversubscribed_scale=scale)
    records = Simulation(spec, profile, [SimRequest(i, 0.0, 500, 1) for i in range(3)]).run()
    return max(r.ttft_s for r in records)


def test_a_prefill_on_oversubscribed_cores_takes_the_fair_share_times_its_scale(profile):
    alone = profile.for_role("decode").prefill_time_s(500)
    assert _slowest_ttft(profile, 2.0, (1.2, 0.9)) == pytest.approx(alone * 1.5 * 1.2)
    assert _slowest_ttft(profile, 2.0, (1.0, 1.0)) == pytest.approx(alone * 1.5)


def test_the_scale_is_left_out_while_the_busy_engines_fit_the_cores(profile):
    alone = profile.for_role("decode").prefill_time_s(500)
    assert _slowest_ttft(profile, 3.0, (1.2, 0.9)) == pytest.approx(alone)


def test_decode_only_steps_take_the_decode_scale(profile):
    """Three long decodes on two cores: after the prefills, every step is decode-only and over-subscribed,
    so the TPOT moves by the decode scale alone."""
    def tpot(scale: tuple[float, float]) -> float:
        spec = ClusterSpec(mode="colocated", num_decode=3, num_cores=2.0, oversubscribed_scale=scale)
        records = Simulation(spec, profile, [SimRequest(i, 0.0, 64, 200) for i in range(3)]).run()
        return max(r.tpot_s for r in records)

    assert tpot((1.0, 0.8)) == pytest.approx(0.8 * tpot((1.0, 1.0)), rel=0.02)
    assert tpot((3.0, 1.0)) == pytest.approx(tpot((1.0, 1.0)), rel=0.02)


@pytest.mark.parametrize("scale", [(0.0, 1.0), (1.0, -1.0), (1.0,)])
def test_a_scale_that_is_not_two_positive_factors_is_refused(scale):
    with pytest.raises(ValueError, match="oversubscribed_scale"):
        ClusterSpec(num_cores=2.0, oversubscribed_scale=scale)


def test_engines_per_host_counts_both_pools_unless_colocated():
    report = {"targets": [{"system": {"mode": "colocated", "decode": {"num_replicas": 3}}},
                          {"system": {"prefill": {"num_replicas": 1}, "decode": {"num_replicas": 2}}},
                          {"system": {}}]}
    assert engines_per_host(report) == 3
    assert engines_per_host({"targets": [{"system": {}}]}) == 2


def test_the_probe_refuses_what_is_not_contention():
    with pytest.raises(ValueError, match="at least 2 engines"):
        measure("tiny", 1, 2.0)


@pytest.mark.slow
def test_the_probe_times_real_engines_together_and_alone():
    """Two one-thread engines of the tiny model, as separate processes, on this machine's cores: positive
    ratios, each factor the ratio over the fair share (no assertion on their size: timings are noisy)."""
    out = measure("tiny", 2, 1.0, window_s=4.0, steps=2)
    assert out["fair_share"] == 2.0
    for shape in ("prefill", "decode"):
        assert out[f"{shape}_ratio"] > 0 and out[shape] == pytest.approx(out[f"{shape}_ratio"] / 2.0)


@pytest.mark.slow
def test_validate_measures_contention_only_where_a_target_ran_more_engines_than_cores(monkeypatch, capsys):
    """prefix-routing-fixed ran three engines on its report's two cores: measured here and modelled;
    disagg-vs-colocated-fixed ran two: nothing to measure, and its figures are those without the flag."""
    monkeypatch.chdir(REPO)
    argv = ["validate", "prefix-routing-fixed", "disagg-vs-colocated-fixed", "--poll-phases", "1", "--json"]
    assert loadtest_main([*argv, "--contention"]) == 0
    out = json.loads(capsys.readouterr().out)
    measured = out["prefix-routing-fixed"]["contention"]
    assert (measured["copies"], measured["cores"], measured["fair_share"]) == (3, 2.0, 1.5)
    assert measured["prefill"] > 0 and measured["decode"] > 0
    assert out["disagg-vs-colocated-fixed"]["contention"] is None
    assert loadtest_main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["disagg-vs-colocated-fixed"]
    assert plain["figures"] == out["disagg-vs-colocated-fixed"]["figures"]


def test_a_scenario_run_measures_contention_only_where_engines_outnumber_the_cores():
    """for_scenario's None path; the measuring path is `measure`, timed above."""
    colocated = [{"mode": "colocated", "decode": {"num_replicas": 2}}]
    assert for_scenario("tiny", colocated, 2) is None and for_scenario("tiny", colocated, None) is None
    assert for_scenario("tiny", [{"prefill": {"num_replicas": 1}, "decode": {"num_replicas": 1}}], 4) is None


def test_a_report_that_measured_its_own_contention_is_modelled_with_it(monkeypatch, capsys, tmp_path):
    """Without the flag, the run's own measurement (a scenario run records it) scales the over-subscribed
    steps; a report without one is modelled as before."""
    monkeypatch.chdir(REPO)
    report = json.loads((REPO / "loadtest/results/prefix-routing-fixed/before-serving-probe/run-1/summary.json")
                        .read_text())
    assert "contention" not in report
    plain_path, own_path = tmp_path / "plain.json", tmp_path / "own.json"
    plain_path.write_text(json.dumps(report))
    own = {"copies": 3, "cores": 2.0, "fair_share": 1.5, "prefill_ratio": 1.8, "decode_ratio": 1.8,
           "prefill": 1.2, "decode": 1.2}
    own_path.write_text(json.dumps({**report, "contention": own}))
    runs = {}
    for name, path in (("plain", plain_path), ("own", own_path)):
        assert loadtest_main(["validate", "prefix-routing-fixed", "--report", str(path), "--poll-phases", "1",
                              "--json"]) == 0
        runs[name] = json.loads(capsys.readouterr().out)["prefix-routing-fixed"]
    assert runs["plain"]["contention"] is None and runs["own"]["contention"] == own
    figure = "round_robin/5.66/tpot_p50_ms"
    assert runs["own"]["figures"][figure]["predicted"] > runs["plain"]["figures"][figure]["predicted"]
    assert runs["own"]["figures"][figure]["measured"] == runs["plain"]["figures"][figure]["measured"]
