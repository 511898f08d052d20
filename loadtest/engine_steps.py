"""Each engine role's stepping time over a load point (pdserve.engine.step_clock): steps, the wall time inside
them, the stepping threads' CPU and their wait for a core, and the gaps between steps. Set against the
simulator's steps it says whether a live step's time is its CPU, its wait for a core, or something that
blocked it.

The load test reads each replica's own stats through its Serve actor before and after a point
(`replica_reader`), exact to the last step. The router's /metrics carries the same counters for operators
(`parse_step_totals` reads them), but a replica there can lag by seconds (it keeps its last snapshot when a
scrape's call to it is slow), which over a 15-40 s point is too coarse."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdserve.engine.step_clock import StepTotals

_FIELDS = {("pdserve_engine_steps", None): "num_steps", ("pdserve_engine_step_gaps", None): "num_gaps",
           ("pdserve_engine_step_seconds", "wall"): "step_s", ("pdserve_engine_step_seconds", "cpu"): "step_cpu_s",
           ("pdserve_engine_step_seconds", "core_wait"): "step_wait_s",
           ("pdserve_engine_step_gap_seconds", "wall"): "gap_s",
           ("pdserve_engine_step_gap_seconds", "core_wait"): "gap_wait_s",
           ("pdserve_engine_prefill_steps", None): "num_prefill_steps",
           ("pdserve_engine_prefill_step_seconds", "wall"): "prefill_step_s",
           ("pdserve_engine_prefill_step_seconds", "cpu"): "prefill_step_cpu_s",
           ("pdserve_engine_prefill_step_seconds", "core_wait"): "prefill_step_wait_s"}


def parse_step_totals(text: str) -> dict[str, tuple[str, StepTotals]]:
    """replica -> (role, its totals), from a Prometheus exposition; replicas that report no steps are absent."""
    found: dict[str, tuple[str, dict[str, float]]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(("pdserve_engine_step", "pdserve_engine_prefill_step")):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            field = _FIELDS.get((family.name, sample.labels.get("part")))
            if field is None:
                continue
            role, values = found.setdefault(sample.labels["replica"], (sample.labels.get("role", ""), {}))
            values[field] = sample.value
    out = {}
    for replica, (role, values) in found.items():
        out[replica] = (role, StepTotals.from_dict({k: int(v) if k.startswith("num_") else v for k, v in values.items()}))
    return out


def read_step_totals(base_url: str, timeout_s: float = 10.0) -> dict[str, tuple[str, StepTotals]]:
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s) as reply:  # noqa: S310
        return parse_step_totals(reply.read().decode())


Reader = Callable[[], dict[str, tuple[str, StepTotals]]]  # replica -> (role, its totals)

SERVE_REPLICA = "SERVE_REPLICA::"  # Serve's replica actors are named SERVE_REPLICA::{app}#{deployment}#{id}


def replica_reader(app: str, timeout_s: float = 10.0) -> Reader:
    """The app's engine replicas' totals, each from its own routing stats (its Serve actor's
    `record_routing_stats`, as the router's poller calls it); role = the deployment's name. Needs this
    process connected to the Ray cluster that runs the app."""
    def read() -> dict[str, tuple[str, StepTotals]]:
        import ray

        actors = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            parts = entry["name"].removeprefix(SERVE_REPLICA).split("#")
            if entry["name"].startswith(SERVE_REPLICA) and len(parts) == 3 and parts[0] == app:
                actors.append((parts[1], parts[2], ray.get_actor(entry["name"], namespace=entry["namespace"])))
        replies = ray.get([actor.record_routing_stats.remote() for *_, actor in actors], timeout=timeout_s)
        return {replica: (role, StepTotals.from_dict(stats["step_totals"]))
                for (role, replica, _), stats in zip(actors, replies)
                if isinstance(stats, dict) and stats.get("step_totals")}

    return read


def metrics_reader(base_url: str) -> Reader:
    return lambda: read_step_totals(base_url)


class StepMeter:
    """Role -> its replicas' stepping time between `start()` and `stop()`, summed, over the replicas that
    reported at both; {} where none reports step counters (an older build) or the reader fails."""

    def __init__(self, read: Reader) -> None:
        self.read = read
        self._before: dict[str, tuple[str, StepTotals]] = {}

    def start(self) -> None:
        self._before = self._read()

    def stop(self) -> dict[str, Any]:
        """Role -> {"replicas": how many were summed, each StepTotals field summed, "each": replica -> its
        steps and wall seconds}; a replica seen at only one end is named under "unmatched"."""
        after, out = self._read(), {}
        for replica, (role, totals) in after.items():
            if replica not in self._before:
                continue
            delta = totals.since(self._before[replica][1])
            summed = out.setdefault(role, {"replicas": 0, **StepTotals().to_dict(), "each": {}})
            summed["replicas"] += 1
            for field, value in delta.to_dict().items():
                summed[field] += value
            summed["each"][replica] = {"num_steps": delta.num_steps, "step_s": delta.step_s}
        for replica in sorted(set(after) ^ set(self._before)):
            role = (after.get(replica) or self._before[replica])[0]
            out.setdefault(role, {"replicas": 0, **StepTotals().to_dict(), "each": {}}).setdefault(
                "unmatched", []).append(replica)
        return dict(sorted(out.items()))

    def _read(self) -> dict[str, tuple[str, StepTotals]]:
        try:
            return self.read()
        except Exception:  # a measurement beside the run, never its failure: the point records none
            return {}
