"""StepClock: where an engine step's wall time goes (its thread's CPU, its wait for a core, the rest), the gaps
between steps, and the counters the replicas expose."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.engine.step_clock import StepClock, StepTotals, ThreadClock
from pdserve.observability.metrics import ServingMetrics
from pdserve.observability.metrics_snapshot import render

LINUX = Path("/proc/thread-self/schedstat").exists()


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_step_is_cpu_and_a_sleeping_one_is_not() -> None:
    clock = StepClock()
    clock.begin()
    spin(0.05)
    clock.end(7, unfinished=False)
    busy = clock.totals
    assert busy.num_steps == 1 and clock.tokens[-1] == 7
    assert busy.step_cpu_s >= 0.05 and busy.step_cpu_s + busy.step_wait_s <= busy.step_s + 1e-3
    clock.begin()
    time.sleep(0.05)
    clock.end(1, unfinished=False)
    slept = clock.totals.since(busy)
    assert slept.num_steps == 1 and slept.step_s >= 0.05 and slept.step_cpu_s < slept.step_s / 2
    assert list(clock.times) == pytest.approx([busy.step_s, slept.step_s])
    clock.close()


def test_steps_that_carry_prompt_tokens_are_also_counted_apart() -> None:
    clock = StepClock()
    for prefill in (True, False, False):
        clock.begin()
        spin(0.01)
        clock.end(1, unfinished=True, prefill=prefill)
    t = clock.totals
    assert (t.num_steps, t.num_prefill_steps) == (3, 1)
    assert t.prefill_step_s == pytest.approx(clock.times[0]) and 0 < t.prefill_step_cpu_s < t.step_cpu_s
    assert t.prefill_step_wait_s <= t.step_wait_s
    clock.close()


def test_gaps_are_counted_only_while_work_is_left() -> None:
    clock = StepClock()
    for unfinished in (True, True, False):
        clock.begin()
        clock.end(1, unfinished)
        time.sleep(0.01)
    t = clock.totals
    assert (t.num_steps, t.num_gaps) == (3, 2) and len(clock.gaps) == 2 and t.gap_s >= 0.02
    clock.begin()  # after a step that left nothing: no gap
    clock.end(1, unfinished=True)
    clock.idle()  # the last request was aborted: no gap either
    clock.begin()
    clock.end(1, unfinished=False)
    assert clock.totals.num_gaps == 2 and clock.totals.num_steps == 5
    assert clock.totals.gap_wait_s <= clock.totals.gap_s
    clock.close()


@pytest.mark.skipif(not LINUX or not hasattr(os, "sched_setaffinity"), reason="needs Linux schedstat and affinity")
def test_a_step_sharing_its_core_with_a_spinning_process_waits_for_it() -> None:
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    hog = subprocess.Popen([sys.executable, "-c", "import os\nos.sched_setaffinity(0, {%d})\nwhile True: pass" % core])
    try:
        os.sched_setaffinity(0, {core})  # this thread only (Linux affinity is per thread)
        time.sleep(0.2)  # the hog is up and pinned
        clock = StepClock()
        clock.begin()
        spin(0.2)
        clock.end(1, unfinished=False)
        t = clock.totals
        assert t.step_cpu_s >= 0.2 and t.step_wait_s > 0.1 * t.step_s  # two runnable on one core: about half
        assert t.step_cpu_s + t.step_wait_s <= t.step_s + 0.01
        clock.close()
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()


def test_thread_clock_reopens_after_close_and_never_goes_backwards() -> None:
    clock = ThreadClock()
    tid, cpu0, wait0 = clock.read()
    spin(0.01)
    clock.close()
    tid1, cpu1, wait1 = clock.read()
    assert tid1 == tid and cpu1 >= cpu0 + 0.01 and wait1 >= wait0
    clock.close()


def test_totals_round_trip_and_difference() -> None:
    a = StepTotals(3, 0.3, 0.2, 0.05, 2, 0.02, 0.01)
    b = StepTotals(5, 0.5, 0.3, 0.1, 4, 0.04, 0.015)
    assert StepTotals.from_dict(a.to_dict()) == a
    d = b.since(a)
    assert d.num_steps == 2 and d.step_s == pytest.approx(0.2) and d.gap_wait_s == pytest.approx(0.005)


def test_replica_metrics_expose_the_totals_as_counters() -> None:
    metrics = ServingMetrics("decode", "r1", "tiny")
    assert b"pdserve_engine_steps_total" not in metrics.render()  # nothing until an engine reports
    metrics.steps.update(StepTotals(4, 0.4, 0.3, 0.05, 3, 0.03, 0.01))
    text = render([metrics.snapshot()]).decode()
    assert 'pdserve_engine_steps_total{model="tiny",replica="r1",role="decode"} 4.0' in text
    assert 'pdserve_engine_step_seconds_total{model="tiny",part="core_wait",replica="r1",role="decode"} 0.05' in text
    assert 'pdserve_engine_step_gap_seconds_total{model="tiny",part="wall",replica="r1",role="decode"} 0.03' in text
