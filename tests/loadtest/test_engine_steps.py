"""The load test's reading of the engines' step counters (pdserve.loadtest.engine_steps) from a real
exposition, as the router renders its workers' snapshots."""

from __future__ import annotations

import pytest

from pdserve.engine.step_clock import StepTotals
from pdserve.loadtest.engine_steps import StepMeter, metrics_reader, parse_step_totals
from pdserve.observability.metrics import ServingMetrics
from pdserve.observability.metrics_snapshot import render


def exposition(totals: dict[str, StepTotals | None]) -> str:
    snapshots = []
    for replica, t in totals.items():
        metrics = ServingMetrics("decode", replica, "tiny")
        metrics.steps.update(t)
        snapshots.append(metrics.snapshot())
    router = ServingMetrics("router", "router-1", "tiny")  # a router reports no steps
    return render([router.snapshot(), *snapshots]).decode()


def test_every_engine_replica_is_read_back_exactly() -> None:
    a, b = StepTotals(10, 0.5, 0.4, 0.05, 9, 0.09, 0.01), StepTotals(3, 0.2, 0.1, 0.0, 2, 0.02, 0.0)
    found = parse_step_totals(exposition({"r1": a, "r2": b, "r3": None}))
    assert found == {"r1": ("decode", a), "r2": ("decode", b)}


def test_the_meter_sums_the_replicas_change_over_its_window() -> None:
    reads = iter([
        exposition({"r1": StepTotals(10, 0.5, 0.4, 0.05, 9, 0.09, 0.01), "r2": StepTotals(1, 0.1, 0.1, 0, 0, 0, 0)}),
        # r2 is gone by the end, r3 started in between: only r1 counts
        exposition({"r1": StepTotals(30, 1.5, 1.0, 0.25, 28, 0.29, 0.05), "r3": StepTotals(5, 0.5, 0.5, 0, 4, 0, 0)}),
    ])
    meter = StepMeter(lambda: parse_step_totals(next(reads)))
    meter.start()
    out = meter.stop()
    assert list(out) == ["decode"] and out["decode"]["replicas"] == 1
    assert out["decode"]["num_steps"] == 20 and out["decode"]["num_gaps"] == 19
    assert out["decode"]["step_s"] == pytest.approx(1.0) and out["decode"]["step_wait_s"] == pytest.approx(0.2)
    assert out["decode"]["each"] == {"r1": {"num_steps": 20, "step_s": pytest.approx(1.0)}}
    assert out["decode"]["unmatched"] == ["r2", "r3"]


def test_a_target_without_metrics_gives_nothing() -> None:
    meter = StepMeter(metrics_reader("http://127.0.0.1:9"))  # nothing listens on the discard port
    meter.start()
    assert meter.stop() == {}
