"""`pdserve-loadtest validate --replication`: the model beside the live runs repeated, per set and per run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdserve.loadtest.cli import main as loadtest_main
from pdserve.loadtest.validation_replication import replication, set_name

REPO = Path(__file__).resolve().parents[3]


def run(measured: float, predicted: float) -> dict:
    return {"figures": {"a/1/ttft_p50_ms": {"measured": measured, "predicted": predicted}}}


def test_each_set_is_predicted_by_the_model_and_by_the_other_sets():
    reports = [Path(f"r/{s}/summary.json") for s in ("day-1/run-1", "day-1/run-2", "day-2/run-1")]
    out = replication(reports, [run(100, 105), run(110, 105), run(200, 190)])
    day1, day2 = out["sets"]["day-1"], out["sets"]["day-2"]
    assert (day1["repetitions"], day1["other_repetitions"]) == (2, 1)
    assert day1["model"]["num_within_target"] == 1 and day1["model"]["max_abs_rel_error"] == 0.0  # 105 vs 105
    assert day1["other_sets"]["max_abs_rel_error"] == pytest.approx(95 / 105)  # 200 vs day 1's median 105
    assert day2["model"]["max_abs_rel_error"] == pytest.approx(0.05)
    assert day2["other_sets"]["max_abs_rel_error"] == pytest.approx(95 / 200)
    assert out["set_totals"] == {"model": {"num_within_target": 2, "num_figures": 2},
                                 "other_sets": {"num_within_target": 0, "num_figures": 2}}
    # per run, within its set: day 1's runs (predicted 105; the other run 110 or 100); day 2's alone has no peer
    assert out["runs"] == {"model": {"num_within_target": 2, "num_figures": 2},
                           "same_set_runs": {"num_within_target": 2, "num_figures": 2}}


def test_one_set_is_refused():
    with pytest.raises(ValueError, match="at least two sets"):
        replication([Path("r/day-1/run-1/summary.json")] * 2, [run(1, 1)] * 2)
    assert set_name(Path("loadtest/results/x/counters-2/run-1/summary.json")) == "counters-2"


def test_validate_replication_on_two_committed_sets(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    scenario = "disagg-vs-colocated-fixed"
    reports = [f"loadtest/results/{scenario}/{s}/run-1/summary.json" for s in ("step-counters", "kv-parts")]
    assert loadtest_main(["validate", scenario, "--report", reports[0], "--report", reports[1], "--replication",
                          "--poll-phases", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)[scenario]["replication"]
    assert set(out["sets"]) == {"step-counters", "kv-parts"}
    assert out["set_totals"]["model"]["num_figures"] == 2 * out["sets"]["kv-parts"]["model"]["num_figures"] > 0
    assert out["runs"]["model"]["num_figures"] == 0  # one run a set: no run has a peer in its set


def test_validate_replication_of_one_set_is_one_line_and_exit_code_2(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert loadtest_main(["validate", "disagg-vs-colocated-fixed", "--replication"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at least two sets" in err and "Traceback" not in err
