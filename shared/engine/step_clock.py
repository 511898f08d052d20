"""Where an engine's stepping time goes: each step's wall time, the stepping thread's CPU within it, and how
long that thread stood runnable waiting for a core (Linux's schedstat run delay); and the same for the gaps
between consecutive steps while requests stayed unfinished. On shared cores a step's wall time is its CPU plus
its wait for a core plus whatever blocked it (the GIL, a lock); the totals tell those apart."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

RECENT = 32  # steps kept for the routers' recent-step figures


@dataclass(frozen=True)
class StepTotals:
    """Cumulative since the engine started, seconds. `*_wait_s` stay 0 where schedstat is absent."""

    num_steps: int = 0
    step_s: float = 0.0  # wall time inside steps
    step_cpu_s: float = 0.0  # the stepping thread's CPU inside steps
    step_wait_s: float = 0.0  # the stepping thread runnable but off-core inside steps
    num_gaps: int = 0
    gap_s: float = 0.0  # a step's end to the next one's start, while requests stayed unfinished
    gap_wait_s: float = 0.0  # the stepping thread runnable but off-core inside those gaps
    # the steps above that carried prompt tokens (a prefill or a chunk of one, with or without decodes)
    num_prefill_steps: int = 0
    prefill_step_s: float = 0.0
    prefill_step_cpu_s: float = 0.0
    prefill_step_wait_s: float = 0.0

    def since(self, before: StepTotals) -> StepTotals:
        return StepTotals(*(getattr(self, f) - getattr(before, f) for f in self.__dataclass_fields__))

    def to_dict(self) -> dict[str, float]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> StepTotals:
        return cls(**{f: d[f] for f in cls.__dataclass_fields__ if f in d})


class ThreadClock:
    """(thread id, CPU seconds, seconds waiting for a core) of the calling thread, cumulative. The CPU is
    CLOCK_THREAD_CPUTIME_ID's (schedstat's own CPU field lags a running thread by up to a tick); the wait is
    schedstat's run delay, complete whenever the thread runs, from one cached descriptor per thread (a pread
    costs about a microsecond)."""

    def __init__(self) -> None:
        self._fds: dict[int, int | None] = {}
        self._lock = threading.Lock()

    def read(self) -> tuple[int, float, float]:
        tid = threading.get_native_id()
        for fresh in (False, True):  # a cached descriptor may be a finished thread's whose id was reused
            fd = self._fds.get(tid, -1)
            if fd == -1 or fresh:
                fd = self._open(tid)
            if fd is None:
                break
            try:
                wait_ns = int(os.pread(fd, 128, 0).split()[1])
                return tid, time.thread_time(), wait_ns / 1e9
            except (OSError, ValueError, IndexError):
                continue
        return tid, time.thread_time(), 0.0

    def _open(self, tid: int) -> int | None:
        try:
            fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            fd = None
        with self._lock:
            if (old := self._fds.get(tid)) is not None:
                os.close(old)
            self._fds[tid] = fd
        return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                if fd is not None:
                    os.close(fd)
            self._fds.clear()


class StepClock:
    """The engine calls `begin()` as a non-empty step starts and `end(tokens, unfinished, prefill)` as it ends
    (`prefill`: the step carried prompt tokens); `unfinished=False` (or `idle()`) means no gap is counted
    until the next step ends with work left."""

    def __init__(self) -> None:
        self.times: deque[float] = deque(maxlen=RECENT)
        self.tokens: deque[int] = deque(maxlen=RECENT)
        self.gaps: deque[float] = deque(maxlen=RECENT)
        self.totals = StepTotals()
        self._thread = ThreadClock()
        self._start: tuple[float, int, float, float] = (0.0, 0, 0.0, 0.0)  # (wall, thread, cpu, wait) at its start
        self._busy_since: tuple[float, int, float] | None = None  # (wall, thread, wait) at the last step's end, work left

    def begin(self) -> None:
        wall = time.perf_counter()
        tid, cpu, wait = self._thread.read()
        self._start = (wall, tid, cpu, wait)
        if self._busy_since is not None:
            since, since_tid, since_wait = self._busy_since
            self.gaps.append(wall - since)
            t = self.totals
            waited = wait - since_wait if tid == since_tid else 0.0  # one thread's counters only
            self.totals = dataclasses.replace(t, num_gaps=t.num_gaps + 1, gap_s=t.gap_s + wall - since,
                                              gap_wait_s=t.gap_wait_s + max(0.0, waited))

    def end(self, num_tokens: int, unfinished: bool, prefill: bool = False) -> None:
        wall = time.perf_counter()
        tid, cpu, wait = self._thread.read()
        w0, tid0, c0, s0 = self._start
        self.times.append(wall - w0)
        self.tokens.append(num_tokens)
        same = tid == tid0  # one thread's counters only
        step, used, waited = wall - w0, max(0.0, cpu - c0) if same else 0.0, max(0.0, wait - s0) if same else 0.0
        t = self.totals
        t = dataclasses.replace(t, num_steps=t.num_steps + 1, step_s=t.step_s + step,
                                step_cpu_s=t.step_cpu_s + used, step_wait_s=t.step_wait_s + waited)
        if prefill:
            t = dataclasses.replace(t, num_prefill_steps=t.num_prefill_steps + 1, prefill_step_s=t.prefill_step_s + step,
                                    prefill_step_cpu_s=t.prefill_step_cpu_s + used,
                                    prefill_step_wait_s=t.prefill_step_wait_s + waited)
        self.totals = t
        self._busy_since = (wall, tid, wait) if unfinished else None

    def idle(self) -> None:
        self._busy_since = None

    def close(self) -> None:
        self._thread.close()
