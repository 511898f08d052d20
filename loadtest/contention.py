"""What-if for `pdserve-loadtest validate --contention`: one-thread steps on an over-subscribed host.

The simulator shares a host's cores fairly: k busy one-thread replicas on c < k cores each run k / c times
slower. Measured on the 2-core AMD EPYC VM (2026-12-01, ad hoc), three one-thread engines together timed a
1,024-token prefill at 1.70x of one alone, and a batch-4 decode step at 1.40x on average (p50 1.2x, p90
1.8x), where fair sharing says 1.5x: a compute-bound prefill loses more than its share, a short decode
step less. Reports before 2026-12-02 did not measure it (`validate --contention`
measures it on the validating machine instead); a scenario run now does, before it deploys anything, where a
target runs more engines than the host has cores (`for_scenario`). This runs `copies` engine processes of the
scenario's model together on this machine, each at one torch thread, through the machine check's prefill
and decode shapes, and one alone before and after. Each factor is together / alone over the fair share
(copies / cores): the model's extra slow-down of a step with a prefill and of a decode-only step
(`ClusterSpec.oversubscribed_scale`) while more one-thread steps run than the host has cores.
"""

from __future__ import annotations

import multiprocessing
import statistics
from typing import Any

PREFILL_TOKENS = 1024  # pdserve.loadtest.machine's prefill_1024
DECODE_BATCH, DECODE_CONTEXT = 8, 1024  # and its decode_b8_ctx1024


def _engine_worker(model: str, seed: int, window_s: float, steps: int, barrier: Any, out: Any) -> None:
    """Each shape repeated for `window_s` after every engine is ready; only what ends inside the window is
    timed, so every timing saw all the engines busy (a last round alone would run faster)."""
    import time

    import torch

    torch.set_num_threads(1)
    from pdserve.bench.profile import Prober
    from pdserve.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    prober = Prober(LLMEngine(EngineConfig(model=model, cache=CacheConfig(block_size=16))), seed)
    prober.prefill(PREFILL_TOKENS)  # warm-up: the first touch of fresh buffers is slow
    prober.decode(DECODE_BATCH, DECODE_CONTEXT, 1)
    medians = []
    for shape in ("prefill", "decode"):
        barrier.wait()
        start, times = time.perf_counter(), []
        while time.perf_counter() - start < window_s:
            if shape == "prefill":
                _, _, seconds = prober.prefill(PREFILL_TOKENS)
            else:
                _, _, seconds = prober.decode(DECODE_BATCH, DECODE_CONTEXT, steps)
            if time.perf_counter() - start < window_s:
                times.append(seconds)
        medians.append(statistics.median(times) if times else float("nan"))
    out.put(tuple(medians))


def _together(model: str, copies: int, window_s: float, steps: int) -> tuple[float, float]:
    """(prefill, decode step) seconds, each the median over `copies` engines busy at the same time."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(copies), ctx.Queue()
    workers = [ctx.Process(target=_engine_worker, args=(model, 100 + i, window_s, steps, barrier, out))
               for i in range(copies)]
    for w in workers:
        w.start()
    try:
        times = [out.get(timeout=600) for _ in workers]
    finally:
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    if any(w.exitcode for w in workers) or any(t != t for pair in times for t in pair):
        raise RuntimeError(f"a contention probe engine failed (exit codes {[w.exitcode for w in workers]}, "
                           f"or no timing ended inside its window)")
    return statistics.median(p for p, _ in times), statistics.median(d for _, d in times)


def measure(model: str, copies: int, cores: float, window_s: float = 8.0, steps: int = 16) -> dict[str, float]:
    """{prefill, decode}: the extra slow-down over the fair share of `copies` one-thread engines on `cores`
    cores, with the raw ratios beside them (one engine alone before and after, averaged)."""
    if copies < 2 or not cores > 0:
        raise ValueError(f"contention needs at least 2 engines and cores > 0, got {copies} and {cores}")
    before = _together(model, 1, window_s / 2, steps)
    shared = _together(model, copies, window_s, steps)
    after = _together(model, 1, window_s / 2, steps)
    alone = [(b + a) / 2 for b, a in zip(before, after)]
    fair = max(1.0, copies / cores)
    ratios = [s / a for s, a in zip(shared, alone)]
    return {"copies": copies, "cores": cores, "fair_share": fair,
            "prefill_ratio": ratios[0], "decode_ratio": ratios[1],
            "prefill": ratios[0] / fair, "decode": ratios[1] / fair}


def for_scenario(model: str, systems: list[dict[str, Any]], cores: int | None) -> dict[str, float] | None:
    """`measure` where some target runs more one-thread engines than the host has cores, else None: what a
    scenario run records (`contention` in its report) for the validation to model."""
    engines = engines_per_host({"targets": [{"system": s} for s in systems]})
    return measure(model, engines, float(cores)) if cores and engines > cores else None


def engines_per_host(report: dict[str, Any]) -> int:
    """The most engines any target of a live report ran on its one host."""
    def engines(system: dict[str, Any]) -> int:
        decode = int((system.get("decode") or {}).get("num_replicas", 1))
        if system.get("mode", "disaggregated") == "colocated":
            return decode
        return decode + int((system.get("prefill") or {}).get("num_replicas", 1))

    return max(engines(t["system"]) for t in report["targets"])
