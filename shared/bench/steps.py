"""Engine step times beside `pdserve bench router`'s TPOT: of a streamed token's time, how much is the
engine's step and how much passes between steps (the engine loop's hand-offs, the stream's work, and
everything else the engine's process runs under the same GIL). The engine's own gaps between
consecutive steps tell whether that time passes in the engine's process."""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

# (step times, gaps between consecutive steps), seconds
ReadSteps = Callable[[], Awaitable[tuple[Sequence[float], Sequence[float]]]]


class StepTimes:
    """Per path and concurrency level, the step times (s) of the engine that served the path's requests,
    read after each request ends: its last `tokens - 1` steps, as far as the engine keeps them (32)."""

    def __init__(self) -> None:
        self.level: int | None = None  # None: not recording (the warm-up)
        self._times: dict[tuple[str, int], list[float]] = {}
        self._gaps: dict[tuple[str, int], list[float]] = {}

    def wrap(self, name: str, one: Callable[..., Awaitable[Any]], read: ReadSteps):
        async def wrapped(i: int, prompt: list[int]):
            sample = await one(i, prompt)  # (TTFT, E2E, tokens, messages)
            if self.level is not None:
                level, (steps, gaps) = self.level, await read()
                num = min(len(steps), max(1, sample[2] - 1))
                self._times.setdefault((name, level), []).extend(steps[len(steps) - num:])
                num = min(len(gaps), max(0, sample[2] - 2))
                self._gaps.setdefault((name, level), []).extend(gaps[len(gaps) - num:])
            return sample

        return wrapped

    def summary(self, name: str, level: int, tpot_ms_p50: float) -> dict[str, float]:
        """`step_ms_p50`; `between_steps_ms`: TPOT p50 less the step p50; `engine_gap_ms_p50`: the engine's
        own time from a step's end to the next one's start. A request's TPOT is a mean over its tokens,
        so `step_ms_mean` + `engine_gap_ms_mean` is what it is to be set against."""
        times = self._times.get((name, level))
        if not times:
            return {}
        step = 1e3 * statistics.median(times)
        out = {"step_ms_p50": round(step, 3), "between_steps_ms": round(tpot_ms_p50 - step, 3),
               "step_ms_mean": round(1e3 * statistics.fmean(times), 3)}
        if gaps := self._gaps.get((name, level)):
            out["engine_gap_ms_p50"] = round(1e3 * statistics.median(gaps), 3)
            out["engine_gap_ms_mean"] = round(1e3 * statistics.fmean(gaps), 3)
        return out


def replica_steps(handle) -> ReadSteps:
    """A Serve worker deployment's step times (its `stats` endpoint; one replica per app here)."""
    async def read() -> tuple[Sequence[float], Sequence[float]]:
        stats = await handle.stats.remote()
        return stats["recent_step_times_s"], stats.get("recent_step_gaps_s", ())

    return read


def engine_steps(engine) -> ReadSteps:
    """An in-process AsyncLLMEngine's step times."""
    async def read() -> tuple[Sequence[float], Sequence[float]]:
        stats = engine.stats()
        return stats.recent_step_times_s, stats.recent_step_gaps_s

    return read
