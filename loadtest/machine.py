"""Is this machine as fast as the one a scenario's latency profile was measured on?

A scenario's absolute SLOs, and the predictions of every router that reads a profile, were set on one
machine; on a slower one every goodput figure moves. Before a scenario deploys anything, the runner
measures the quick profile (what `pdserve profile --quick` measures) on the scenario's model and compares
it with each profile file the scenario names, at reference shapes: a 1024-token prefill, decode steps of 1
and 8 sequences at 1024 tokens of context each, and 512 new tokens behind a 1024-token cached prefix. The
ratios (measured / profiled) go into summary.json and summary.md, with a verdict from the first three
(`SPEED_SHAPES`): `slower` when a ratio is above `SLOW_RATIO`, `faster` when one is below its inverse, else
`matches`. The cached-prefix shape also measures how well the profile's fit prices a prefix hit.

Each shape is timed at the torch threads of the replicas that run it (`replica_threads`: a one-CPU replica
runs one thread), not at the load-test process's default: on the 2-core VM one thread against two made a
1024-token prefill 1.8x slower and a batch-8 decode step 1.33x, a gap the calibration would otherwise take
for serving cost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.latency_model import LatencyModel, LatencyProfile

SLOW_RATIO = 1.3  # re-measuring one machine minutes apart moved a shape by up to 1.19x here
# (shape, role whose model the profile file gives for it, seconds under a latency model)
SHAPES: tuple[tuple[str, str, Callable[[LatencyModel], float]], ...] = (
    ("prefill_1024", "prefill", lambda m: m.prefill_time_s(1024)),
    ("decode_b1_ctx1024", "decode", lambda m: m.decode_step_s(1, 1024)),
    ("decode_b8_ctx1024", "decode", lambda m: m.decode_step_s(8, 8 * 1024)),
    # new tokens behind a long cached prefix (a prefix-cache hit): the profile's n x cached term
    ("prefill_512_cached1024", "prefill", lambda m: m.prefill_time_s(512, 1024)),
)
SPEED_SHAPES = frozenset(("prefill_1024", "decode_b1_ctx1024", "decode_b8_ctx1024"))  # the verdict's


@dataclass(frozen=True)
class MachineCheck:
    profile_path: str
    # (shape, the profile's seconds, this machine's seconds)
    shapes: tuple[tuple[str, float, float], ...]
    # (shape, torch threads it was timed at); empty: the process's default threads (reports before this)
    threads: tuple[tuple[str, int], ...] = field(default=())

    @property
    def ratios(self) -> dict[str, float]:
        return {name: measured / profiled for name, profiled, measured in self.shapes}

    @property
    def speed_ratios(self) -> list[float]:
        """The ratios of the speed shapes (a cached-prefix shape measures the profile's fit too)."""
        return [r for name, r in self.ratios.items() if name in SPEED_SHAPES]

    @property
    def slowest(self) -> float:
        return max(self.speed_ratios)

    @property
    def verdict(self) -> str:
        if self.slowest > SLOW_RATIO:
            return "slower"
        return "faster" if min(self.speed_ratios) < 1 / SLOW_RATIO else "matches"

    def to_dict(self) -> dict[str, Any]:
        threads = dict(self.threads)
        return {"profile_path": self.profile_path, "verdict": self.verdict, "slowest_ratio": self.slowest,
                "shapes": [{"shape": name, "profile_ms": profiled * 1e3, "measured_ms": measured * 1e3,
                            "ratio": measured / profiled, **({"threads": threads[name]} if name in threads else {})}
                           for name, profiled, measured in self.shapes]}


def describe(check: Mapping[str, Any]) -> str:
    """A check's figures in one line, from its `to_dict()` form (what summary.json holds)."""
    parts = ", ".join(f"{s['shape']} {s['profile_ms']:.1f} → {s['measured_ms']:.1f} ms"
                      + (f" at {s['threads']} thread{'s' * (s['threads'] != 1)}" if "threads" in s else "")
                      for s in check["shapes"])
    return f"{check['slowest_ratio']:.2f}× the time of `{check['profile_path']}` at worst ({parts})"


def profile_paths(machine_profile: str | None, systems: Iterable[Mapping[str, Any]]) -> list[str]:
    """The scenario's reference profile and every profile a target's router reads, each once, in order."""
    paths = [machine_profile] if machine_profile else []
    for system in systems:
        path = (system.get("router") or {}).get("profile_path")
        if path:
            paths.append(str(path))
    return list(dict.fromkeys(paths))


def replica_threads(system: Mapping[str, Any]) -> dict[str, int]:
    """Torch threads of the replicas that run each role's shapes in a target's system (as a dict): a worker
    runs max(1, int(num_cpus)) threads (1 CPU when unstated); colocated replicas (the decode pool) prefill too."""
    def threads(role: str) -> int:
        return max(1, int(float((system.get(role) or {}).get("num_cpus", 1.0))))

    disaggregated = system.get("mode", "disaggregated") == "disaggregated"
    return {"prefill": threads("prefill" if disaggregated else "decode"), "decode": threads("decode")}


def _at_threads(measure: Callable[[str], LatencyModel], model: str, threads: int) -> LatencyModel:
    import torch

    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure(model)
    finally:
        torch.set_num_threads(default)


def check_machine(
    model: str, paths: Iterable[str], measure: Callable[[str], LatencyModel] | None = None,
    threads: Mapping[str, int] | None = None,
) -> list[MachineCheck]:
    """One MachineCheck per profile file; the machine is measured once per thread count, and only if there
    is a file. `threads`: per role ("prefill", "decode"), the torch threads its shapes are timed at
    (`replica_threads`); None: the process's default."""
    paths = list(paths)
    if not paths:
        return []
    if measure is None:
        from pdserve.bench.profile import run

        def measure(m: str) -> LatencyModel:
            return run(m, quick=True)

    if threads is None:
        default = measure(model)
        measured = {role: default for _, role, _ in SHAPES}
    else:
        by_count = {n: _at_threads(measure, model, n) for n in dict.fromkeys(threads[r] for _, r, _ in SHAPES)}
        measured = {role: by_count[threads[role]] for _, role, _ in SHAPES}
    timed_at = () if threads is None else tuple((name, threads[role]) for name, role, _ in SHAPES)
    checks = []
    for path in paths:
        profile = LatencyProfile.load(Path(path))
        shapes = tuple((name, seconds(profile.for_role(role)), seconds(measured[role]))
                       for name, role, seconds in SHAPES)
        checks.append(MachineCheck(str(path), shapes, timed_at))
    return checks
