"""Engine step times beside `pdserve bench router`'s TPOT: of a streamed token's time, how much is the
engine's step and how much passes between steps (the engine loop's hand-offs, the stream's work, and
everything else the engine's process runs under the same GIL)."""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

ReadSteps = Callable[[], Awaitable[Sequence[float]]]


class StepTimes:
    """Per path and concurrency level, the step times (s) of the engine that served the path's requests,
    read after each request ends: its last `tokens - 1` steps, as far as the engine keeps them (32)."""

    def __init__(self) -> None:
        self.level: int | None = None  # None: not recording (the warm-up)
        self._times: dict[tuple[str, int], list[float]] = {}

    def wrap(self, name: str, one: Callable[..., Awaitable[Any]], read: ReadSteps):
        async def wrapped(i: int, prompt: list[int]):
            sample = await one(i, prompt)  # (TTFT, E2E, tokens, messages)
            if self.level is not None:
                level, steps = self.level, await read()
                num = min(len(steps), max(1, sample[2] - 1))
                self._times.setdefault((name, level), []).extend(steps[len(steps) - num:])
            return sample

        return wrapped

    def summary(self, name: str, level: int, tpot_ms_p50: float) -> dict[str, float]:
        """`step_ms_p50`, and `between_steps_ms`: TPOT p50 less the step p50."""
        times = self._times.get((name, level))
        if not times:
            return {}
        step = 1e3 * statistics.median(times)
        return {"step_ms_p50": round(step, 3), "between_steps_ms": round(tpot_ms_p50 - step, 3)}


def replica_steps(handle) -> ReadSteps:
    """A Serve worker deployment's step times (its `stats` endpoint; one replica per app here)."""
    async def read() -> Sequence[float]:
        return (await handle.stats.remote())["recent_step_times_s"]

    return read


def engine_steps(engine) -> ReadSteps:
    """An in-process AsyncLLMEngine's step times."""
    async def read() -> Sequence[float]:
        return engine.stats().recent_step_times_s

    return read
