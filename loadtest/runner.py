"""One load run: open loop (an arrival schedule) or closed loop (fixed concurrency), bounded by both
a request count and a wall-clock deadline; requests unfinished at the deadline are cancelled."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.loadtest.arrivals import ARRIVALS, arrival_process
from pdserve.loadtest.client import RequestResult, new_client, send
from pdserve.loadtest.metrics import RunSummary, summarize
from pdserve.loadtest.workloads import RequestSpec, TokenSource, Workload


@dataclass(frozen=True)
class LoadConfig:
    num_requests: int = 100
    max_duration_s: float = 300.0
    arrival: Literal["poisson", "gamma", "constant", "trace"] = "poisson"
    burstiness: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.max_duration_s <= 0:
            raise ValueError("num_requests must be >= 1 and max_duration_s > 0")
        if self.arrival not in (*ARRIVALS, "trace"):
            raise ValueError(f"unknown arrival {self.arrival!r}; known: {sorted(ARRIVALS)} and 'trace'")


@dataclass
class Run:
    results: list[RequestResult]
    duration_s: float
    summary: RunSummary
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "summary": self.summary.to_dict(), "requests": [r.to_dict() for r in self.results]}


def run_seed(seed: int, rate: float | None, concurrency: int | None = None) -> int:
    """One seed per load point: each rate gets fresh prompts (no prefix-cache hits from an earlier run),
    and every target sees the same prompts at the same rate."""
    return zlib.crc32(f"{seed}:{rate!r}:{concurrency!r}".encode())


def progress_bar(total: int, label: str, enabled: bool | None) -> Any:
    from tqdm import tqdm

    enabled = sys.stderr.isatty() if enabled is None else enabled
    return tqdm(total=total, desc=label, unit="req", disable=not enabled, leave=False, dynamic_ncols=True)


async def run_load(
    base_url: str, model: str, specs: list[RequestSpec], deadline_s: float, *,
    schedule: list[float] | None = None, concurrency: int | None = None,
    on_done: Callable[[RequestResult], None] = lambda r: None,
) -> tuple[list[RequestResult], float]:
    """Exactly one of `schedule` (open loop) and `concurrency` (closed loop). Returns (results, duration)."""
    if (schedule is None) == (concurrency is None):
        raise ValueError("give a schedule (open loop) or a concurrency (closed loop)")
    results = [RequestResult(i, s.prompt_len, s.output_len, schedule[i] if schedule else 0.0)
               for i, s in enumerate(specs)]
    connections = concurrency or len(specs)
    async with new_client(max(1, connections)) as client:
        t0 = time.perf_counter()
        finished_at = t0

        async def one(i: int) -> None:
            nonlocal finished_at
            await send(client, base_url, model, specs[i], results[i], t0)
            finished_at = max(finished_at, time.perf_counter())
            on_done(results[i])

        async def timed(i: int) -> None:
            delay = t0 + results[i].scheduled_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await one(i)

        next_index = iter(range(len(specs)))

        async def worker() -> None:
            for i in next_index:
                results[i].scheduled_s = time.perf_counter() - t0
                await one(i)

        if schedule is not None:
            tasks = [asyncio.create_task(timed(i)) for i in range(len(specs))]
        else:
            tasks = [asyncio.create_task(worker()) for _ in range(min(concurrency, len(specs)))]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    duration = deadline_s if pending else finished_at - t0
    return results, duration


def run_point(
    base_url: str, model: str, tokens: TokenSource, workload: Workload, load: LoadConfig, *,
    rate: float | None = None, concurrency: int | None = None, progress: bool | None = None, label: str = "",
) -> Run:
    """Builds the requests for this load point (seeded by rate) and runs them."""
    seed = run_seed(load.seed, rate, concurrency)
    specs = workload.requests(tokens, load.num_requests, seed)
    schedule = None
    if concurrency is None:
        if load.arrival == "trace":
            trace = workload.arrivals(load.num_requests)
            if trace is None:
                raise ValueError("arrival 'trace' needs a workload with timestamps (mooncake)")
            process = dataclasses.replace(trace, rate=rate)  # rate None: replay at the recorded pace
        else:
            if rate is None:
                raise ValueError("an open-loop run needs a rate")
            options = {"burstiness": load.burstiness} if load.arrival == "gamma" else {}
            process = arrival_process(load.arrival, rate, **options)
        schedule = process.schedule(load.num_requests, seed)
    label = label or (f"concurrency {concurrency}" if concurrency else f"{rate:g} req/s" if rate else "trace")
    bar = progress_bar(len(specs), label, progress)
    try:
        results, duration = asyncio.run(run_load(
            base_url, model, specs, load.max_duration_s, schedule=schedule, concurrency=concurrency,
            on_done=lambda r: bar.update(1),
        ))
    finally:
        bar.close()
    return Run(results, duration, summarize(results, duration, rate, concurrency), seed)
