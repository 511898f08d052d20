"""`pdserve-loadtest ratio` (pdserve.loadtest.goodput_ratio): where attainment crosses the target, ratios of
bounds, pooling repeated runs, and the command on the committed repeated runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pdserve.loadtest.goodput_ratio import (
    Goodput, bootstrap, crossing, crossing_figure, goodput_ratios, pooled, ratio,
)

REPO = Path(__file__).resolve().parents[2]
FIXED = REPO / "loadtest/results/disagg-vs-colocated-fixed"


@pytest.mark.parametrize("points, expected", [
    ([(0.5, 1.0), (1.0, 0.8)], Goodput(0.75, "exact")),  # halfway from 1.0 to 0.8
    ([(1.0, 0.8), (0.5, 1.0)], Goodput(0.75, "exact")),  # order does not matter
    ([(0.5, 0.9), (1.0, 0.6)], Goodput(0.5, "exact")),  # exactly at the target passes
    ([(0.5, 0.95), (1.0, 0.97)], Goodput(1.0, "at_least")),  # every rate passed
    ([(0.5, 0.8), (1.0, 0.7)], Goodput(0.5, "below")),  # none did
    ([(0.25, 1.0), (0.5, 0.5), (1.0, 0.95)], Goodput(1.0, "at_least")),  # the highest passing rate counts
    ([(0.25, 1.0), (0.5, 0.95), (1.0, 0.5), (2.0, 0.0)], Goodput(0.5 + 0.5 * 0.05 / 0.45, "exact")),
])
def test_goodput_is_where_attainment_crosses_the_target(points, expected):
    got = crossing(points, 0.9)
    assert got.bound == expected.bound and got.rps == pytest.approx(expected.rps)


def test_a_validation_figure_reads_both_sides_at_their_crossing():
    measured = [{"rate": 1.0, "attainment": 1.0}, {"rate": 1.5, "attainment": 0.8}, {"rate": 2.0, "attainment": 0.5}]
    figure = crossing_figure({1.0: 0.95, 1.5: 0.97, 2.0: 0.93}, measured, 0.9)
    assert figure == {"predicted": 2.0, "measured": pytest.approx(1.25), "predicted_bound": "at_least",
                      "measured_bound": "exact"}


@pytest.mark.parametrize("a, b, expected", [
    (Goodput(1.5, "exact"), Goodput(0.5, "exact"), (3.0, "exact")),
    (Goodput(1.0, "at_least"), Goodput(0.5, "exact"), (2.0, "at_least")),
    (Goodput(1.0, "exact"), Goodput(0.5, "below"), (2.0, "at_least")),
    (Goodput(1.0, "at_least"), Goodput(0.5, "below"), (2.0, "at_least")),
    (Goodput(0.5, "below"), Goodput(1.0, "exact"), (0.5, "at_most")),
    (Goodput(1.0, "exact"), Goodput(1.0, "at_least"), (1.0, "at_most")),
    (Goodput(1.0, "at_least"), Goodput(1.0, "at_least"), (None, "unknown")),
    (Goodput(0.5, "below"), Goodput(0.5, "below"), (None, "unknown")),
    (Goodput(1.0, "exact"), Goodput(0.0, "exact"), (None, "unknown")),
])
def test_a_ratio_of_bounds_is_a_bound_or_unknown(a, b, expected):
    value, bound = ratio(a, b)
    assert bound == expected[1] and (value == pytest.approx(expected[0]) if expected[0] else value is None)


def report(points: dict[str, list[tuple[float, float, int]]], goodput: float = 0.5) -> dict:
    return {"attainment_target": 0.9, "slo_reference": "d", "targets": [
        {"name": name, "goodput": goodput, "points": [
            {"rate": r, "attainment": a, "summary": {"counts": {"total": n}}} for r, a, n in pts]}
        for name, pts in points.items()]}


def test_runs_pool_by_rate_weighted_by_requests_and_each_run_keeps_its_own_ratio():
    runs = [report({"d": [(0.5, 1.0, 30), (1.0, 0.8, 30)], "c": [(0.5, 0.9, 30), (1.0, 0.6, 30)]}),
            report({"d": [(0.5, 1.0, 10), (1.0, 1.0, 10)], "c": [(0.5, 0.8, 10), (1.0, 0.5, 10)]})]
    assert pooled(runs, "d") == [(0.5, 1.0, 40), (1.0, pytest.approx(0.85), 40)]
    out = goodput_ratios(runs)["d/c"]
    assert [(r["ratio"], r["bound"]) for r in out["runs"]] == [(pytest.approx(1.5), "exact"), (2.0, "at_least")]
    assert out["runs_range"] == [pytest.approx(1.5), pytest.approx(1.5)] and out["runs_exact"] == 1
    # pooled: d crosses 0.9 at 0.5 + 0.5 * 0.1 / 0.15; c at 0.5 + 0.5 * (0.875 - 0.9) ... fails at 0.5: below
    c = pooled(runs, "c")
    assert c[0][1] == pytest.approx(0.875)
    assert out["pooled"]["bound"] == "at_least" and out["pooled"]["ratio"] == pytest.approx((0.5 + 0.5 / 1.5) / 0.5)


def test_the_bootstrap_interval_holds_the_ratio_and_tightens_with_requests():
    few = bootstrap([(0.5, 1.0, 30), (1.0, 0.8, 30)], [(0.25, 1.0, 30), (0.5, 0.8, 30)], 0.9, samples=400)
    many = bootstrap([(0.5, 1.0, 3000), (1.0, 0.8, 3000)], [(0.25, 1.0, 3000), (0.5, 0.8, 3000)], 0.9, samples=400)
    point = ratio(crossing([(0.5, 1.0), (1.0, 0.8)], 0.9), crossing([(0.25, 1.0), (0.5, 0.8)], 0.9))[0]
    assert point == pytest.approx(2.0)
    assert many[0] <= point <= many[1] and many[1] - many[0] < 0.5
    assert few[0] is None or few[0] <= many[0]  # fewer requests: a wider (or unbounded) interval
    assert few[1] is None or few[1] >= many[1]


def test_the_committed_repeated_runs_give_a_ratio_per_run_and_pooled():
    out = subprocess.run([sys.executable, "-m", "pdserve.loadtest.cli", "ratio", str(FIXED), "--json"],
                         capture_output=True, text=True, cwd=REPO, check=True)
    got = json.loads(out.stdout)
    assert len(got["reports"]) >= 3
    pair = got["ratios"]["disaggregated/colocated-no-chunking"]
    assert pair["repetitions"] == len(got["reports"]) == len(pair["runs"])
    assert set(got["ratios"]) == {"disaggregated/colocated-no-chunking", "disaggregated/colocated-chunked"}
    for run in pair["runs"]:  # the grid's goodput is the report's own
        assert set(run["grid_goodput"]) == {"disaggregated", "colocated-no-chunking"}


@pytest.mark.parametrize("args, message", [
    (["ratio", "/nonexistent-results"], "no summary.json"),
    (["ratio", str(FIXED), "--target", "nope"], "no target 'nope'"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    out = subprocess.run([sys.executable, "-m", "pdserve.loadtest.cli", *args], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stderr


def test_a_malformed_report_is_named(tmp_path):
    (tmp_path / "summary.json").write_text("{not json")
    out = subprocess.run([sys.executable, "-m", "pdserve.loadtest.cli", "ratio", str(tmp_path)],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and "summary.json: not JSON" in out.stderr
