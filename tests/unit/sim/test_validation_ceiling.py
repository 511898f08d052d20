"""`pdserve-loadtest validate --noise-ceiling`: the chance an exact model meets the target, against closed forms,
and its shape on a committed scenario."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdserve.loadtest.cli import main as loadtest_main
from pdserve.loadtest.validation_ceiling import RunPhases, ceiling

REPO = Path(__file__).resolve().parents[3]


def run_of(values: list[float], predicted: float, attainments: list[float] | None = None) -> RunPhases:
    """One target at one rate whose TTFT p50 takes `values` over the phases."""
    attainments = attainments or [1.0] * len(values)
    return RunPhases(phases=len(values),
                     points={"t/1": [{"ttft_p50_ms": v, "slo_attainment": a} for v, a in zip(values, attainments)]},
                     rates={"t": [1.0]}, predicted={"t/1/ttft_p50_ms": predicted, "t/goodput_rps": 1.0})


def test_a_figure_no_phase_moves_always_meets_the_target():
    out = ceiling([run_of([100.0], 100.0)], goal=0.9, draws=200)
    assert all(r["p_all_within_target"] == 1.0 for r in out["by_repetitions"].values())
    assert out["num_figures_phase_spread_over_target"] == 0 and out["figures_below_0.95"] == {}


def test_two_modes_a_third_apart_never_meet_it_whatever_the_repetitions():
    """An odd number of draws from {100, 200} has its median at 100 or 200: 0.5 or 0.33 from a prediction
    of 150 (0.5 or 0.25: errors are over the measured), whatever the count."""
    out = ceiling([run_of([100.0, 200.0], 150.0)], goal=0.9, draws=500)
    assert all(r["p_all_within_target"] == 0.0 for r in out["by_repetitions"].values())
    assert out["figures_below_0.95"] == {"t/1/ttft_p50_ms": 0.0}


def test_one_mode_in_three_out_of_reach_matches_the_binomial():
    """Phases {90, 100, 150} against a prediction of 100: one draw misses with p = 1/3 (150 is 33% off);
    the median of three misses when two or three draws are 150: 3 (1/3)^2 (2/3) + (1/3)^3 = 7/27."""
    out = ceiling([run_of([90.0, 100.0, 150.0], 100.0)], goal=0.9, draws=20000, repetitions=(1, 3))
    assert out["by_repetitions"]["1"]["p_all_within_target"] == pytest.approx(2 / 3, abs=0.015)
    assert out["by_repetitions"]["3"]["p_all_within_target"] == pytest.approx(20 / 27, abs=0.015)


def test_goodput_is_read_where_the_drawn_attainment_crosses():
    """Two rates; at the second the attainment is 1.0 or 0.8 by phase: goodput 2.0 (at least) or the
    crossing at 1.5, 25% under a prediction of 2.0."""
    run = RunPhases(phases=2, rates={"t": [1.0, 2.0]}, predicted={"t/goodput_rps": 2.0},
                    points={"t/1": [{"slo_attainment": 1.0}] * 2,
                            "t/2": [{"slo_attainment": 1.0}, {"slo_attainment": 0.8}]})
    out = ceiling([run], goal=0.9, draws=4000, repetitions=(1,))
    assert out["by_repetitions"]["1"]["p_all_within_target"] == pytest.approx(0.5, abs=0.04)


def test_the_ceiling_beside_a_committed_scenarios_validation(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    assert loadtest_main(["validate", "disagg-vs-colocated-fixed", "--report",
                          "loadtest/results/disagg-vs-colocated-fixed/run-1/summary.json",
                          "--poll-phases", "2", "--noise-ceiling", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["disagg-vs-colocated-fixed"]
    out = result["noise_ceiling"]
    assert out["live_repetitions"] == 1 and out["phases"] == 32
    assert set(out["by_repetitions"]) == {"1", "3", "5", "9", "15"}
    for r in out["by_repetitions"].values():
        assert 0.0 <= r["p_all_within_target"] <= 1.0
        assert r["max_abs_rel_error_p50"] <= r["max_abs_rel_error_p90"]
    assert set(out["figures_below_0.95"]) <= set(result["figures"])


def test_a_bisecting_sweeps_goodput_is_left_out():
    """Its live rates are not the ones the simulator tried, so a drawn goodput has nothing to compare with."""
    run = run_of([100.0], 100.0)
    run.fixed_grid = False
    out = ceiling([run], goal=0.9, draws=100)
    assert out["left_out"] == ["t/goodput_rps"]
    assert all(r["p_all_within_target"] == 1.0 for r in out["by_repetitions"].values())
