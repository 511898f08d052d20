"""Metrics as plain data, so replicas can ship them to the router, and their merge into one exposition.

A snapshot is `{"version": 1, "families": [{"name", "type", "help", "samples": [[name, labels, value]]}]}`:
only str/float/dict/list, so it pickles through Ray and serialises as JSON. Each replica's series carry
its own `replica` label, so merging is a union; a series present in several snapshots (same name and
labels) is summed for counters and histograms, and the last one wins for gauges.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

SNAPSHOT_VERSION = 1
CONTENT_TYPE = CONTENT_TYPE_LATEST
_ADDITIVE = frozenset({"counter", "histogram"})

Snapshot = dict[str, Any]


def snapshot_of(collector: Collector) -> Snapshot:
    """What `collector` (e.g. a CollectorRegistry) exposes now, less the per-process `_created` samples."""
    families = []
    for metric in collector.collect():
        samples = [
            [s.name, dict(s.labels), float(s.value)]
            for s in metric.samples
            if not s.name.endswith("_created")
        ]
        families.append(
            {"name": metric.name, "type": metric.type, "help": metric.documentation, "samples": samples}
        )
    return {"version": SNAPSHOT_VERSION, "families": families}


def merge(snapshots: Iterable[Snapshot]) -> list[Metric]:
    """One metric family per name across all snapshots; families whose type disagrees with the first
    snapshot that had them (a replica on another version) are skipped."""
    kinds: dict[str, tuple[str, str]] = {}
    series: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for snapshot in snapshots:
        if snapshot.get("version") != SNAPSHOT_VERSION:
            continue
        for family in snapshot["families"]:
            name, kind = family["name"], family["type"]
            if kinds.setdefault(name, (kind, family["help"]))[0] != kind:
                continue
            values = series.setdefault(name, {})
            for sample_name, labels, value in family["samples"]:
                key = (sample_name, tuple(sorted(labels.items())))
                if kind in _ADDITIVE and key in values:
                    values[key] += value
                else:
                    values[key] = value
    merged = []
    for name, (kind, help_text) in kinds.items():
        metric = Metric(name, help_text, kind)
        for (sample_name, labels), value in series[name].items():
            metric.add_sample(sample_name, dict(labels), value)
        merged.append(metric)
    return merged


class SnapshotCollector:
    """A prometheus_client collector over fixed snapshots (register it, or pass it to generate_latest)."""

    def __init__(self, snapshots: Iterable[Snapshot]) -> None:
        self._snapshots = list(snapshots)

    def collect(self) -> Iterator[Metric]:
        yield from merge(self._snapshots)

    def describe(self) -> list[Metric]:
        return []


def render(snapshots: Iterable[Snapshot]) -> bytes:
    """The Prometheus text exposition (media type CONTENT_TYPE) of the merged snapshots."""
    return generate_latest(SnapshotCollector(snapshots))
