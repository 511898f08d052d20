"""The router's bounded queue: a request that no replica can take within its SLOs waits at the router,
first in first out, instead of piling onto the least-bad replica or being refused at once.

Only the head of the queue tries again, every `retry_s` (the stats poll period: new stats are what can
change the answer), so queued requests leave in arrival order. A new request always tries once first:
one with looser SLOs may be placeable while the head is not. A request gives up with a Rejection after
`timeout_s` in the queue ("queue_timeout"); one that finds `max_requests` already waiting is refused at
once ("queue_full"). `max_requests` 0: no queue, the first Rejection stands.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from pdserve.placement.policy import Rejection

T = TypeVar("T")


class PlacementQueue(Generic[T]):
    def __init__(self, max_requests: int, timeout_s: float, retry_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_requests, self.timeout_s, self.retry_s = max_requests, timeout_s, retry_s
        self._clock = clock
        self._waiting: deque[object] = deque()
        self.num_queued = self.num_timed_out = self.num_full = 0  # counts since start

    def __len__(self) -> int:
        return len(self._waiting)

    async def place(self, attempt: Callable[[], Awaitable[T | Rejection]]) -> T | Rejection:
        """`attempt()` (the placement step) until it places, within the queue's bounds."""
        result = await attempt()
        if not isinstance(result, Rejection) or self.max_requests == 0:
            return result
        if len(self._waiting) >= self.max_requests:
            self.num_full += 1
            return Rejection("queue_full", max(result.retry_after_s, self.retry_s))
        ticket = object()
        self._waiting.append(ticket)
        self.num_queued += 1
        deadline = self._clock() + self.timeout_s
        try:
            while True:
                left = deadline - self._clock()
                if left <= 0:
                    self.num_timed_out += 1
                    return Rejection("queue_timeout", max(result.retry_after_s, self.retry_s))
                await asyncio.sleep(min(self.retry_s, left))
                if self._waiting[0] is ticket:
                    result = await attempt()
                    if not isinstance(result, Rejection):
                        return result
        finally:
            self._waiting.remove(ticket)
