"""`pdserve-loadtest validate` and `python -m pdserve.sim plan`: their output's shape, and bad input as one
line and exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdserve.loadtest.cli import main as loadtest_main
from pdserve.loadtest.goodput_ratio import crossing
from pdserve.sim.cli import main as sim_main
from pdserve.sim.cluster import Simulation
from pdserve.sim.config import SimRequest
from pdserve.sim.plan import PlanSpec, find_rate, plan_cluster, trace_lengths

REPO = Path(__file__).resolve().parents[3]
PROFILE = REPO / "loadtest/scenarios/profiles/random-llama-h512-l4.json"
REPORT = REPO / "loadtest/results/disagg-vs-colocated/summary.json"


def test_validate_puts_each_measured_figure_beside_a_prediction(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(REPO)
    out = tmp_path / "validation.json"
    out.write_text(json.dumps({"other-scenario": {"max_abs_rel_error": 0.0, "figures": {}}}))
    assert loadtest_main(["validate", "disagg-vs-colocated", "--json", "--write", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    result = printed["disagg-vs-colocated"]
    report = json.loads(REPORT.read_text())
    expected = {f"{t['name']}/goodput_rps" for t in report["targets"]}
    for t in report["targets"]:
        for p in t["points"]:
            expected |= {f"{t['name']}/{p['rate']:.3g}/{k}" for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms",
                                                                     "tpot_p90_ms")}
    assert set(result["figures"]) == expected
    for name, fig in result["figures"].items():
        assert isinstance(fig["predicted"], float) and isinstance(fig["measured"], float), name
    goodput = result["figures"]["disaggregated/goodput_rps"]  # where attainment crosses the target
    points = [(p["rate"], p["attainment"]) for p in report["targets"][0]["points"]]
    assert goodput["measured"] == pytest.approx(crossing(points, report["attainment_target"]).rps)
    assert goodput["measured_bound"] in ("exact", "at_least", "below")
    grid = result["grid_figures"]  # the sweep's own goodput, beside the figures and not counted in them
    assert set(grid) == {f"{t['name']}/grid_goodput_rps" for t in report["targets"]}
    assert grid["disaggregated/grid_goodput_rps"]["measured"] == report["targets"][0]["goodput"]
    p = next(p for p in report["targets"][0]["points"] if p["rate"] == 0.25)
    assert result["figures"]["disaggregated/0.25/ttft_p90_ms"]["measured"] == p["summary"]["ttft_ms"]["p90"]
    errors = [abs(f["predicted"] - f["measured"]) / f["measured"] for f in result["figures"].values() if f["measured"]]
    assert result["max_abs_rel_error"] == pytest.approx(max(errors))
    assert result["calibration"]["disaggregated"]["source"] == "machine check"
    assert result["poll_phases"] == 8  # each prediction the median over the polls' phases
    assert json.loads(out.read_text()).keys() == {"other-scenario", "disagg-vs-colocated"}


@pytest.mark.parametrize(("argv", "needle"), [
    (["validate", "no-such-scenario"], "cannot read scenario"),
    (["validate", "disagg-vs-colocated", "--report", "{missing}"], "cannot read report"),
    (["validate", "disagg-vs-colocated", "--report", "{garbage.json}"], "not JSON"),
    (["validate", "disagg-vs-colocated", "--report", "{other.json}"], "not a scenario report"),
    (["validate", "disagg-vs-colocated", "--profile", "{garbage.json}"], "not a latency profile"),
    (["validate", "disagg-vs-colocated", "--profile", "{missing}"], "cannot read profile"),
    (["validate", "disagg-vs-colocated", "--serving-cores", "2"], "--serving-cores 2"),
    (["validate", "disagg-vs-colocated", "--serving-cores", "-0.5"], "--serving-cores -0.5"),
    (["validate", "disagg-vs-colocated", "--replica-threads", "0"], "--replica-threads must be >= 1"),
    (["validate", "disagg-vs-colocated", "--poll-phases", "0"], "--poll-phases 0"),
])
def test_validate_bad_input_is_one_line_and_exit_code_2(monkeypatch, tmp_path, capsys, argv, needle):
    monkeypatch.chdir(REPO)
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"scenario": "x"}')
    argv = [str(tmp_path / a[1:-1]) if a.startswith("{") else a for a in argv]
    assert loadtest_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_find_rate_doubles_then_bisects():
    capacity = 37.0
    seen = []

    def attainment(rate: float) -> float:
        seen.append(rate)
        return 1.0 if rate <= capacity else 0.5

    rate = find_rate(attainment, 1.0, 0.9, steps=8)
    assert seen[:7] == [1, 2, 4, 8, 16, 32, 64]
    assert 32 <= rate <= capacity and capacity / rate < 1.05


def test_plan_compares_both_shapes_at_the_same_gpu_count(profile):
    trace = [SimRequest(i, 0.0, p, 16) for i, p in enumerate((200, 400, 800))]
    spec = PlanSpec(gpus=10, unit_gpus=3, ttft_slo_s=0.5, tpot_slo_s=0.05, window_s=5.0, min_requests=20,
                    chunk_budgets=(512,), bisect_steps=2, unchunked=False)
    result = plan_cluster(profile, trace_lengths(trace), spec)
    assert set(result["shapes"]) == {"disaggregated 1P+2D", "disaggregated 2P+1D", "colocated 3x chunk 512"}
    d, c = result["disaggregated"], result["colocated"]
    assert d["gpus_used"] == c["gpus_used"] == 9 and d["units"] == 3
    assert d["prefill_replicas"] + d["decode_replicas"] == 9 and c["decode_replicas"] == 9
    unit = result["shapes"][d["unit"]]
    assert d["goodput_rps"] == pytest.approx(3 * unit["unit_goodput_rps"]) and unit["unit_goodput_rps"] > 0
    assert d["goodput_rps"] == max(
        3 * s["unit_goodput_rps"] for s in result["shapes"].values() if s["mode"] == "disaggregated")
    assert d["routers"] >= 1 and d["redis_bytes"] > 0
    with pytest.raises(ValueError, match="unit_gpus"):
        PlanSpec(gpus=4, unit_gpus=8)


def test_plan_models_the_routers_kv_parts(profile):
    """Long prompts prefilled in chunks of a KV part cost the prefill pool more steps: the disaggregated unit's
    TTFT at a fixed rate is lower with the whole KV moved after the prefill (0) than with 64-token parts."""
    from pdserve.sim.plan import _shapes

    trace = [SimRequest(i, 0.05 * i, 800, 8) for i in range(20)]
    ttft = {}
    for parts in (64, None):
        spec = PlanSpec(gpus=3, unit_gpus=3, kv_part_tokens=parts)
        name, cluster = next(s for s in _shapes(spec) if s[0] == "disaggregated 2P+1D")
        assert cluster.router.kv_part_tokens == parts
        records = Simulation(cluster, profile, trace).run()
        ttft[parts] = sum(r.ttft_s for r in records) / len(records)
    assert ttft[None] < ttft[64]
    with pytest.raises(ValueError, match="kv-part-tokens"):
        PlanSpec(kv_part_tokens=0)


@pytest.mark.parametrize(("argv", "needle"), [
    (["plan", "--trace", "{missing}"], "cannot read trace"),
    (["plan", "--trace", "{garbage.jsonl}"], "not a trace record"),
    (["plan", "--profile", "{missing}"], "cannot read profile"),
    (["plan", "--profile", "{garbage.json}"], "not a latency profile"),
    (["plan", "--gpus", "4", "--unit-gpus", "8"], "unit_gpus"),
    (["plan", "--kv-part-tokens", "-5"], "--kv-part-tokens must be >= 0"),
])
def test_plan_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, argv, needle):
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "garbage.jsonl").write_text('{"timestamp": 1, "input_length": 5}\n')
    argv = [str(tmp_path / a[1:-1]) if a.startswith("{") else a for a in argv]
    assert sim_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_validate_calibrates_off_step_cpu_on_the_lowest_rate_and_checks_it_on_the_others(monkeypatch, capsys):
    """prefix-routing's report measured its replicas' CPU per point: the off-step cost per token comes from
    the lowest rate (where the model's CPU then equals the measured within 1%: a fixed point, three rounds),
    and every other point's CPU is predicted beside its measurement. A report without CPU
    (disagg-vs-colocated) gets no such cost."""
    monkeypatch.chdir(REPO)
    assert loadtest_main(["validate", "prefix-routing", "disagg-vs-colocated", "--poll-phases", "1",
                          "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    prefix = printed["prefix-routing"]
    report = json.loads((REPO / "loadtest/results/prefix-routing/summary.json").read_text())
    for t in report["targets"]:
        assert prefix["calibration"][t["name"]]["off_step_cpu_token_s"] > 0
        lowest = min(p["rate"] for p in t["points"])
        assert prefix["replica_cpu"][f"{t['name']}/{lowest:.3g}"]["model_share"] == pytest.approx(1.0, rel=0.01)
        for p in t["points"]:
            cpu = prefix["replica_cpu"][f"{t['name']}/{p['rate']:.3g}"]
            assert cpu["measured_s"] == pytest.approx(p["replica_cpu_s"]["decode"])
    assert all(c["off_step_cpu_token_s"] == 0 for c in printed["disagg-vs-colocated"]["calibration"].values())
    assert "replica_cpu" not in printed["disagg-vs-colocated"]


def test_serving_cores_are_taken_from_the_hosts_cores(monkeypatch, capsys):
    """A what-if: half a core kept busy outside the replicas leaves the model 1.5 of the report's 2 cores,
    and slows its loaded points (TPOT p90 at the highest rate rises)."""
    monkeypatch.chdir(REPO)
    runs = []
    for cores in ("0", "0.5"):
        assert loadtest_main(["validate", "router-policies", "--serving-cores", cores, "--poll-phases", "1",
                              "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out)["router-policies"])
    assert (runs[0]["num_cores"], runs[1]["num_cores"], runs[1]["serving_cores"]) == (2, 1.5, 0.5)
    figure = "least_loaded/1/tpot_p90_ms"
    assert runs[1]["figures"][figure]["predicted"] > runs[0]["figures"][figure]["predicted"]


def test_the_batch_probe_calibrates_a_cost_per_step_and_relay_the_idle_gap_per_row(monkeypatch, capsys):
    """On the committed fixed runs (each target has a batch probe): `step` puts the serving layer's decode time
    on every step, `relay` on every row from the idle probe, as before the batch probe."""
    monkeypatch.chdir(REPO)
    runs = {}
    for cost in ("step", "relay"):
        assert loadtest_main(["validate", "disagg-vs-colocated-fixed", "--serving-cost", cost,
                              "--poll-phases", "1", "--json"]) == 0
        runs[cost] = json.loads(capsys.readouterr().out)["disagg-vs-colocated-fixed"]
        assert runs[cost]["serving_cost"] == cost
    for run in runs["step"]["runs"]:
        for cal in run["calibration"].values():
            assert cal["serving_step_s"] > 0 and cal["relay_token_s"] == 0
    relays = [cal["relay_token_s"] for run in runs["relay"]["runs"] for cal in run["calibration"].values()]
    assert any(r > 0 for r in relays)
    assert all(cal["serving_step_s"] == 0 for run in runs["relay"]["runs"] for cal in run["calibration"].values())
    figure = "disaggregated/1/tpot_p50_ms"  # the same measurement, another prediction
    assert runs["step"]["figures"][figure]["measured"] == runs["relay"]["figures"][figure]["measured"]
    assert runs["step"]["figures"][figure]["predicted"] != runs["relay"]["figures"][figure]["predicted"]


def test_an_unknown_serving_cost_is_refused(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_:
        loadtest_main(["validate", "disagg-vs-colocated-fixed", "--serving-cost", "magic"])
    assert exit_.value.code == 2 and "--serving-cost" in capsys.readouterr().err


def test_repeated_runs_are_combined_per_figure_as_medians_with_their_ranges():
    from pdserve.loadtest.validation_runs import combine

    def run(measured, predicted, bound="exact"):
        return {"figures": {"a/1/ttft_p50_ms": {"predicted": predicted, "measured": measured}}, "report": "r",
                "grid_figures": {"a/grid_goodput_rps": {"predicted": 1.0, "measured": measured / 100}},
                "max_abs_rel_error": abs(predicted - measured) / measured}

    out = combine([run(100.0, 110.0), run(140.0, 120.0), run(90.0, 100.0)])
    fig = out["figures"]["a/1/ttft_p50_ms"]
    assert (fig["measured"], fig["predicted"]) == (100.0, 110.0)
    assert fig["measured_range"] == [90.0, 140.0] and fig["predicted_range"] == [100.0, 120.0]
    assert fig["measured_spread"] == pytest.approx(0.25) and fig["within_measured_range"]
    assert fig["rel_error"] == pytest.approx(0.1) and out["max_abs_rel_error"] == pytest.approx(0.1)
    assert (out["repetitions"], out["num_within_target"], out["num_measured_spread_over_target"]) == (3, 1, 1)
    grid = out["grid_figures"]["a/grid_goodput_rps"]  # combined the same way, not counted
    assert (grid["measured"], grid["predicted"], grid["measured_range"]) == (1.0, 1.0, [0.9, 1.4])
    assert out["num_figures"] == 1
    single = run(100.0, 110.0)
    assert combine([single]) is single


def test_validate_takes_a_report_per_repetition(monkeypatch, capsys):
    """`--report` twice: the same report twice combines to the single report's figures, with no spread."""
    monkeypatch.chdir(REPO)
    one_phase = ["--poll-phases", "1", "--json"]
    assert loadtest_main(["validate", "disagg-vs-colocated", "--report", str(REPORT), *one_phase]) == 0
    once = json.loads(capsys.readouterr().out)["disagg-vs-colocated"]
    assert loadtest_main(["validate", "disagg-vs-colocated", "--report", str(REPORT), "--report", str(REPORT),
                          *one_phase]) == 0
    twice = json.loads(capsys.readouterr().out)["disagg-vs-colocated"]
    assert twice["repetitions"] == 2 and twice["max_measured_spread"] == 0.0
    assert {k: v["predicted"] for k, v in twice["figures"].items()} == \
        {k: v["predicted"] for k, v in once["figures"].items()}
    assert twice["max_abs_rel_error"] == pytest.approx(once["max_abs_rel_error"])


def test_a_runs_engines_stats_are_modelled_as_its_code_kept_them():
    """Reports from code whose engines count requests waiting for a step in flight say so in their provenance;
    older ones do not, and their engines are simulated with such requests unseen."""
    from pdserve.loadtest.provenance import STATS_COUNT_ARRIVING, provenance
    from pdserve.loadtest.validation_model import counts_arriving

    assert STATS_COUNT_ARRIVING in provenance()["features"]
    assert counts_arriving({"provenance": provenance()})
    assert not counts_arriving({"provenance": {"commit": "5e7d0df"}}) and not counts_arriving({})
    assert counts_arriving({}, "counted") and not counts_arriving({"provenance": provenance()}, "unseen")
    with pytest.raises(ValueError, match="mid-step arrivals 'sometimes'"):
        counts_arriving({}, "sometimes")


def test_a_runs_kv_handoff_is_modelled_as_its_router_did_it():
    """The router hands a long prompt's KV over in parts from commit fcd3b0e on: reports naming the feature,
    or dated from then, are simulated with parts (prefill chunks of a part); older ones whole."""
    from pdserve.loadtest.provenance import KV_PARTS, provenance
    from pdserve.loadtest.validate import load_scenario
    from pdserve.loadtest.validation_model import Model, hands_kv_in_parts
    from pdserve.sim.scenario import load_profile

    assert KV_PARTS in provenance()["features"] and hands_kv_in_parts({"provenance": provenance()})
    assert hands_kv_in_parts({"provenance": {"commit": "12283a5", "date": "2026-11-29 13:47 UTC"}})
    assert not hands_kv_in_parts({"provenance": {"commit": "309b17d", "date": "2026-11-23 21:04 UTC"}})
    assert not hands_kv_in_parts({})
    assert hands_kv_in_parts({}, "on") and not hands_kv_in_parts({"provenance": provenance()}, "off")
    with pytest.raises(ValueError, match="kv parts 'maybe'"):
        hands_kv_in_parts({}, "maybe")
    scenario = load_scenario(str(REPO / "loadtest/scenarios/disagg-vs-colocated-fixed.yaml"))
    for path, parts in (("disagg-vs-colocated-fixed/run-1", 256), ("disagg-vs-colocated", None)):
        report = json.loads((REPO / "loadtest/results" / path / "summary.json").read_text())
        profile = load_profile(str(REPO / "loadtest/scenarios/profiles/random-llama-h512-l4.json"))
        model = Model(scenario, report, profile, poll_phases=1)
        target = next(t for t in report["targets"] if t["name"] == "disaggregated")
        assert model.spec(target).router.kv_part_tokens == parts


def test_the_clis_copies_of_the_validations_choices_match_their_modules():
    """The CLI names them without importing the simulator (it starts light); the copies must not drift."""
    from pdserve.loadtest import cli, validation_model
    from pdserve.sim import config

    assert cli.POLL_PHASES == validation_model.POLL_PHASES
    assert cli.MID_STEP_ARRIVALS == validation_model.MID_STEP_ARRIVALS
    assert cli.KV_PARTS == validation_model.KV_PARTS_CHOICES
    assert cli.CORE_SHARING == validation_model.CORE_SHARING_CHOICES
    assert validation_model.CORE_SHARING_CHOICES[:2] == config.CORE_SHARING
    from pdserve.loadtest import validate

    assert cli.CALIBRATE_ON == validate.CALIBRATE_ON


def test_all_runs_finds_every_set_of_repeated_runs(tmp_path):
    from pdserve.loadtest.validation_runs import all_report_paths

    for run in ("run-1", "kv-parts/run-2", "kv-parts/run-1", "older/set/run-3", "notes/summary-1"):
        (tmp_path / run).mkdir(parents=True)
        (tmp_path / run / "summary.json").write_text("{}")
    (tmp_path / "summary.json").write_text("{}")  # a single report beside the runs is not a repetition
    assert [p.relative_to(tmp_path).as_posix() for p in all_report_paths(tmp_path)] == [
        "kv-parts/run-1/summary.json", "kv-parts/run-2/summary.json", "older/set/run-3/summary.json",
        "run-1/summary.json"]


def test_validate_all_runs_pools_every_committed_set(monkeypatch, capsys):
    """`--all-runs`: every set under the scenario's results, each run simulated on its own."""
    monkeypatch.chdir(REPO)
    runs = sorted((REPO / "loadtest/results/disagg-vs-colocated-fixed").glob("**/run-*/summary.json"))
    assert len(runs) >= 6
    assert loadtest_main(["validate", "disagg-vs-colocated-fixed", "--all-runs", "--poll-phases", "1",
                          "--json"]) == 0
    pooled = json.loads(capsys.readouterr().out)["disagg-vs-colocated-fixed"]
    assert pooled["repetitions"] == len(runs)
    assert sorted(r["report"] for r in pooled["runs"]) == sorted(str(p.relative_to(REPO)) for p in runs)


@pytest.mark.parametrize(("argv", "needle"), [
    (["validate", "disagg-vs-colocated-fixed", "--all-runs", "--report", "x.json"], "choose one"),
    (["validate", "{scenario.yaml}", "--all-runs"], "no run-*/summary.json at any depth"),
])
def test_validate_all_runs_bad_input_is_one_line_and_exit_code_2(monkeypatch, tmp_path, capsys, argv, needle):
    scenario = (REPO / "loadtest/scenarios/disagg-vs-colocated-fixed.yaml").read_text()
    renamed = scenario.replace("name: disagg-vs-colocated-fixed", "name: no-runs-yet")
    (tmp_path / "scenario.yaml").write_text(renamed)
    monkeypatch.chdir(tmp_path)
    argv = [str(tmp_path / a[1:-1]) if a.startswith("{") else a for a in argv]
    assert loadtest_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_calibrate_on_each_point_is_a_what_if_beside_the_prediction(monkeypatch, capsys):
    """`--calibrate-on each`: every point above the lowest rate simulated with a calibration from its own
    measurements (here its engines' step counters); the lowest rate's prediction and every measurement as
    before."""
    monkeypatch.chdir(REPO)
    report = "loadtest/results/prefix-routing-fixed/step-counters/run-1/summary.json"
    out = {}
    for on in ("lowest", "each"):
        assert loadtest_main(["validate", "prefix-routing-fixed", "--report", report, "--poll-phases", "1",
                              "--calibrate-on", on, "--json"]) == 0
        out[on] = json.loads(capsys.readouterr().out)["prefix-routing-fixed"]
        assert out[on]["calibrate_on"] == on
    lowest, each = out["lowest"], out["each"]
    for name, figure in lowest["figures"].items():
        assert each["figures"][name]["measured"] == figure["measured"], name
        if "/2/" in name or name.endswith("goodput_rps"):  # the lowest rate, and goodput: the lowest's calibration
            assert each["figures"][name]["predicted"] == figure["predicted"], name
    moved = [n for n in lowest["figures"] if "/5.66/" in n
             and each["figures"][n]["predicted"] != lowest["figures"][n]["predicted"]]
    assert len(moved) == 8  # both targets' four latency figures
    for target in ("least_loaded", "round_robin"):
        cal = each["calibration"][target]
        assert set(cal["each_point"]) == {"4", "5.66"} and "each_point" not in lowest["calibration"][target]
        assert cal["each_point"]["5.66"]["serving_step_s"] != cal["serving_step_s"]


def test_calibrate_on_refuses_what_it_does_not_know(monkeypatch, capsys):
    from pdserve.loadtest.validate import load_scenario, validate

    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_:
        loadtest_main(["validate", "prefix-routing-fixed", "--calibrate-on", "highest"])
    assert exit_.value.code == 2 and "--calibrate-on" in capsys.readouterr().err
    with pytest.raises(ValueError, match="calibrate on 'highest'"):
        validate(load_scenario("prefix-routing-fixed"),
                 REPO / "loadtest/results/prefix-routing-fixed/run-1/summary.json", calibrate_on="highest")
