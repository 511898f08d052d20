"""What-if for `pdserve-loadtest validate --replica-threads N`: the machine check at the replicas' threads.

A report's machine check (pdserve.loadtest.machine) runs in the load-test process at torch's default
threads (the host's cores), while each replica of the committed scenarios runs one torch thread
(`num_cpus: 1`). The simulator scales the profile by that check, so it models a replica's step at the
host's thread count. The reports did not measure the check at the replicas' threads; this measures, on
the machine validate runs on, each check shape at N threads and at the default, and scales each report's
check by their ratio (on the 2-core AMD EPYC VM on 2026-11-29, at one thread against two, for the
scenarios' random Llama: prefill_1024 1.80x, decode_b1_ctx1024 1.10x, decode_b8_ctx1024 1.33x).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from pdserve.latency_model import LatencyModel
from pdserve.loadtest.machine import SHAPES


def with_thread_factors(check: Mapping[str, Any], factors: Mapping[str, float]) -> dict[str, Any]:
    """A machine check (summary.json form) with each shape's measured time times its factor; a shape that
    records the threads it was timed at (the runner's check since it times the replicas' threads) is kept."""
    missing = {s["shape"] for s in check["shapes"] if "threads" not in s} - set(factors)
    if missing:
        raise ValueError(f"no thread factor for the machine check's shapes {sorted(missing)}")
    out = copy.deepcopy(dict(check))
    for shape in out["shapes"]:
        if "threads" in shape:
            continue
        shape["measured_ms"] *= factors[shape["shape"]]
        shape["ratio"] = shape["measured_ms"] / shape["profile_ms"]
    return out


def thread_factors(model: str, threads: int, rounds: int = 2,
                   measure: Callable[[str], LatencyModel] | None = None) -> dict[str, float]:
    """Each check shape's time at `threads` torch threads over its time at the default, on this machine
    (the quick profile at each, alternating, `rounds` times; the medians' ratio)."""
    import statistics

    import torch

    if threads < 1:
        raise ValueError(f"--replica-threads must be >= 1, got {threads}")
    if measure is None:
        from pdserve.bench.profile import run

        def measure(m: str) -> LatencyModel:
            return run(m, quick=True)

    default = torch.get_num_threads()
    times: dict[int, list[dict[str, float]]] = {threads: [], default: []}
    try:
        for _ in range(rounds):
            for n in dict.fromkeys((threads, default)):
                torch.set_num_threads(n)
                fitted = measure(model)
                times[n].append({name: seconds(fitted) for name, _, seconds in SHAPES})
    finally:
        torch.set_num_threads(default)
    def median(n: int, name: str) -> float:
        return statistics.median(t[name] for t in times[n])

    return {name: median(threads, name) / median(default, name) for name, _, _ in SHAPES}
