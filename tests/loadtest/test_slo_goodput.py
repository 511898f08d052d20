"""SLO attainment, request goodput, relative SLOs, and the bisection that finds DistServe goodput."""

from __future__ import annotations

import pytest
from pdserve.loadtest.client import RequestResult
from pdserve.loadtest.slo import SLO, IdleLatency, SLOSpec, attainment, request_goodput
from pdserve.loadtest.sweep import SweepConfig, find_goodput


def ok(ttft: float, tpot: float, tokens: int = 11) -> RequestResult:
    e2e = ttft + tpot * (tokens - 1)
    return RequestResult(0, 10, tokens, 0.0, 0.0, "ok", 200, [ttft, e2e], e2e, tokens)


SLO_ = SLO(ttft_s=0.5, tpot_s=0.05)


def test_attainment_counts_failures_as_misses():
    results = [
        ok(0.4, 0.04),  # good
        ok(0.5, 0.05),  # good: bounds are inclusive
        ok(0.6, 0.01),  # TTFT miss
        ok(0.1, 0.06),  # TPOT miss
        RequestResult(0, 10, 11, 0.0, 0.0, "rejected", 429),
        RequestResult(0, 10, 11, 0.0, 0.0, "error", 500),
        RequestResult(0, 10, 11, 0.0),  # cancelled
        ok(0.3, 10.0, tokens=1),  # one token: no TPOT, judged on TTFT
    ]
    assert attainment(results, SLO_) == pytest.approx(3 / 8)
    assert request_goodput(results, SLO_, duration_s=2.0) == pytest.approx(1.5)
    assert attainment([], SLO_) == 0.0


def test_relative_slo_is_a_factor_of_idle_latency():
    spec = SLOSpec(ttft_factor=5, tpot_factor=2)
    slo = spec.resolve(IdleLatency(ttft_s=0.2, tpot_s=0.01))
    assert slo.ttft_s == pytest.approx(1.0) and slo.tpot_s == pytest.approx(0.02)
    mixed = SLOSpec(ttft_ms=300, tpot_factor=3).resolve(IdleLatency(0.2, 0.01))
    assert mixed.ttft_s == pytest.approx(0.3) and mixed.tpot_s == pytest.approx(0.03)
    assert SLOSpec(ttft_ms=300, tpot_ms=40).resolve(None) == SLO(0.3, 0.04)
    with pytest.raises(ValueError):
        spec.resolve(None)
    with pytest.raises(ValueError):
        SLOSpec(ttft_ms=1, ttft_factor=2, tpot_ms=1)
    with pytest.raises(ValueError):
        SLOSpec(ttft_ms=1)


def step(threshold: float, calls: list[float]):
    def measure(rate: float) -> float:
        calls.append(rate)
        return 1.0 if rate <= threshold else 0.5
    return measure


def test_bisection_brackets_the_threshold():
    calls: list[float] = []
    config = SweepConfig(rates=(0.5, 1.0, 2.0, 4.0), max_runs=20, rel_tol=0.02)
    result = find_goodput(step(1.37, calls), config)
    assert calls[:4] == [0.5, 1.0, 2.0, 4.0]  # the grid first, whole
    lo, hi = result.bracket
    assert lo <= 1.37 < hi and (hi - lo) / lo <= 0.02
    assert result.goodput == lo and not result.capped
    assert all(calls[i] < 2.0 and calls[i] > 1.0 for i in range(4, len(calls)))


def test_bisection_respects_the_run_budget():
    calls: list[float] = []
    result = find_goodput(step(1.37, calls), SweepConfig(rates=(1.0, 2.0), max_runs=4, rel_tol=1e-6))
    assert len(calls) == 4
    assert 1.0 <= result.goodput <= 1.37


def test_every_rate_passing_is_capped_and_none_passing_is_zero():
    capped = find_goodput(step(100.0, []), SweepConfig(rates=(1.0, 2.0), max_runs=5))
    assert capped.goodput == 2.0 and capped.capped and capped.bracket == (2.0, None)
    none = find_goodput(step(0.1, calls := []), SweepConfig(rates=(1.0, 2.0), max_runs=5))
    assert none.goodput == 0.0 and not none.capped and calls == [1.0, 2.0, 0.5, 0.25, 0.125]


def test_a_failing_grid_is_extended_downwards_by_halving():
    calls: list[float] = []
    result = find_goodput(step(0.3, calls), SweepConfig(rates=(1.0, 2.0), max_runs=6, rel_tol=0.2))
    assert calls[:4] == [1.0, 2.0, 0.5, 0.25]  # halve below the grid until a rate passes, then bisect
    lo, hi = result.bracket
    assert lo <= 0.3 < hi and result.goodput == lo > 0


def test_non_monotone_grid_bisects_below_the_first_failure():
    values = {1.0: 1.0, 2.0: 0.5, 3.0: 0.95}
    result = find_goodput(lambda r: values.get(r, 1.0 if r < 1.5 else 0.0), SweepConfig((1.0, 2.0, 3.0), 8, 0.05))
    assert 1.0 <= result.goodput < 1.5 and result.bracket[1] <= 2.0


def test_attainment_target_is_90_percent_by_default():
    result = find_goodput(lambda r: 0.9 if r <= 1.0 else 0.89, SweepConfig((1.0, 2.0), 2))
    assert result.goodput == 1.0


def test_sweep_config_validation():
    with pytest.raises(ValueError):
        SweepConfig(rates=(2.0, 1.0))
    with pytest.raises(ValueError):
        SweepConfig(rates=(1.0, 2.0, 3.0), max_runs=2)
