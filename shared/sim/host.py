"""CPU beyond the engine steps, per generated token, on a host whose cores the replicas share; and the
steps themselves sharing those cores.

A live replica spends CPU per generated token outside the step it times: detokenising, streaming the
token to the router, its event loop; the router, the Serve proxy and the load client spend more on the
same token. On an idle host that work overlaps the next step on a free core and adds nothing to latency;
once the cores are busy it takes capacity from every step. `OffStepLoad` keeps that work over a sliding
window and reports it in cores, which `Simulation._sharing` adds to the busy steps' threads.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class OffStepLoad:
    def __init__(self, cpu_per_token_s: float, window_s: float = 1.0) -> None:
        if cpu_per_token_s < 0 or not window_s > 0:
            raise ValueError("cpu_per_token_s must be >= 0 and window_s > 0")
        self.cpu_per_token_s, self.window_s = cpu_per_token_s, window_s
        self._spent: deque[tuple[float, float]] = deque()  # (when, CPU seconds), oldest first
        self._total = 0.0

    def add(self, now: float, tokens: int) -> float:
        """Records `tokens` generated at `now`; returns the CPU seconds they cost."""
        cpu = tokens * self.cpu_per_token_s
        if cpu > 0:
            self._spent.append((now, cpu))
            self._total += cpu
        return cpu

    def cores(self, now: float) -> float:
        """Cores kept busy by the off-step work of the last window."""
        while self._spent and self._spent[0][0] <= now - self.window_s:
            self._total -= self._spent.popleft()[1]
        return max(0.0, self._total) / self.window_s


@dataclass
class _Step:
    left_s: float  # profiled seconds still to run
    threads: float
    rate: float  # profiled seconds run per second
    since: float  # when left_s was last brought up to date
    wake_s: float = 0.0  # the woken thread's wait for a core where all are taken, before it runs
    begins: float | None = None  # when it starts to run: set at the first reshare after it starts


class SharedCores:
    """Steps in flight on one host's cores, shared continuously (processor sharing): each progresses at
    min(1, cores / demand) of its profiled speed, the demand being the threads of every step in flight plus the
    cores the off-step and background work keep busy. Rates are recomputed whenever a step starts or ends, so a
    long prefill slows when another replica's step starts beside it, and speeds up when that one ends. A step
    may first wait `wake_s` x (1 - its first rate) for a core (ClusterSpec.wake_wait_s), counted in the demand."""

    def __init__(self, num_cores: float) -> None:
        if not num_cores > 0:
            raise ValueError(f"num_cores must be > 0, got {num_cores}")
        self.num_cores = num_cores
        self._steps: dict[object, _Step] = {}

    def start(self, key: object, profiled_s: float, threads: float, now: float, wake_s: float = 0.0) -> None:
        self._advance(now)
        self._steps[key] = _Step(profiled_s, threads, 1.0, now, wake_s)

    def finish(self, key: object, now: float) -> None:
        self._advance(now)
        del self._steps[key]

    def reshare(self, now: float, other_cores: float) -> dict[object, float]:
        """Each step's projected end, at the rate the current demand leaves it."""
        self._advance(now)
        demand = sum(s.threads for s in self._steps.values()) + other_cores
        rate = min(1.0, self.num_cores / demand) if demand > 0 else 1.0
        for step in self._steps.values():
            step.rate = rate
            if step.begins is None:
                step.begins = now + step.wake_s * (1.0 - rate)
        return {key: max(now, s.begins) + s.left_s / rate for key, s in self._steps.items()}  # type: ignore[type-var]

    def _advance(self, now: float) -> None:
        for step in self._steps.values():
            ran = now - max(step.since, step.begins if step.begins is not None else step.since)
            step.left_s = max(0.0, step.left_s - max(0.0, ran) * step.rate)
            step.since = now
