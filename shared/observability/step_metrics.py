"""An engine's stepping time as Prometheus counters, from its cumulative `StepTotals`: steps and the seconds
inside them (wall, the stepping thread's CPU, its wait for a core), and the gaps between consecutive steps.
`rate(pdserve_engine_step_seconds_total{part="wall"}[1m])` is how busy the engine is; wall well above cpu
says the replica is short of cores (core_wait) or blocked (the rest: the GIL, locks)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

if TYPE_CHECKING:
    from pdserve.engine.step_clock import StepTotals

LABELS = ("role", "replica", "model")


class StepCollector:
    """Reports the last `update()`d totals at every collection; nothing until the first."""

    def __init__(self, label_values: tuple[str, ...]) -> None:
        self._labels = list(label_values)
        self.totals: StepTotals | None = None

    def update(self, totals: StepTotals | None) -> None:
        self.totals = totals

    def collect(self) -> Iterator[Metric]:
        t = self.totals
        if t is None:
            return
        steps = CounterMetricFamily("pdserve_engine_steps", "Engine steps run", labels=LABELS)
        steps.add_metric(self._labels, t.num_steps)
        seconds = CounterMetricFamily(
            "pdserve_engine_step_seconds", "Seconds inside engine steps: wall, the stepping thread's cpu, and "
            "its core_wait (runnable, waiting for a core)", labels=[*LABELS, "part"])
        for part, value in (("wall", t.step_s), ("cpu", t.step_cpu_s), ("core_wait", t.step_wait_s)):
            seconds.add_metric([*self._labels, part], value)
        gaps = CounterMetricFamily(
            "pdserve_engine_step_gap_seconds", "Seconds between consecutive engine steps while requests stayed "
            "unfinished: wall, and the stepping thread's core_wait within them", labels=[*LABELS, "part"])
        for part, value in (("wall", t.gap_s), ("core_wait", t.gap_wait_s)):
            gaps.add_metric([*self._labels, part], value)
        num_gaps = CounterMetricFamily("pdserve_engine_step_gaps", "Gaps between consecutive engine steps while "
                                       "requests stayed unfinished", labels=LABELS)
        num_gaps.add_metric(self._labels, t.num_gaps)
        prefill_steps = CounterMetricFamily("pdserve_engine_prefill_steps", "Engine steps that carried prompt "
                                            "tokens (a prefill or a chunk of one)", labels=LABELS)
        prefill_steps.add_metric(self._labels, t.num_prefill_steps)
        prefill_seconds = CounterMetricFamily(
            "pdserve_engine_prefill_step_seconds", "Seconds inside engine steps that carried prompt tokens: wall, "
            "cpu and core_wait, as pdserve_engine_step_seconds", labels=[*LABELS, "part"])
        for part, value in (("wall", t.prefill_step_s), ("cpu", t.prefill_step_cpu_s),
                            ("core_wait", t.prefill_step_wait_s)):
            prefill_seconds.add_metric([*self._labels, part], value)
        yield from (steps, seconds, gaps, num_gaps, prefill_steps, prefill_seconds)

    def describe(self) -> list[Metric]:
        return []
