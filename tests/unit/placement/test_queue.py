"""The router's bounded placement queue: FIFO, only the head retries, bounded in size and time."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.placement.policy import Rejection
from pdserve.placement.queue import PlacementQueue

FULL = Rejection("tpot", 1.0)


class Capacity:
    """Placement attempts that succeed while `free` slots remain; records who got them, in order."""

    def __init__(self, free: int = 0) -> None:
        self.free, self.placed, self.attempts = free, [], 0

    def attempt(self, name: str):
        async def run():
            self.attempts += 1
            if self.free > 0:
                self.free -= 1
                self.placed.append(name)
                return name
            return FULL
        return run


def test_without_a_queue_the_first_refusal_stands():
    cap = Capacity()
    queue = PlacementQueue(0, 1.0, 0.01)
    assert asyncio.run(queue.place(cap.attempt("a"))) is FULL and cap.attempts == 1


def test_a_queued_request_is_placed_when_capacity_frees():
    async def run():
        cap, queue = Capacity(), PlacementQueue(4, 5.0, 0.01)
        task = asyncio.create_task(queue.place(cap.attempt("a")))
        await asyncio.sleep(0.05)
        assert len(queue) == 1 and not task.done()
        cap.free = 1
        assert await task == "a"
        assert len(queue) == 0 and queue.num_queued == 1
    asyncio.run(run())


def test_later_arrivals_never_overtake_the_head():
    async def run():
        cap, queue = Capacity(), PlacementQueue(8, 5.0, 0.005)
        tasks = []
        for name in "abcd":
            tasks.append(asyncio.create_task(queue.place(cap.attempt(name))))
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.03)
        cap.free = 4
        assert await asyncio.gather(*tasks) == list("abcd")
        assert cap.placed == list("abcd")
    asyncio.run(run())


def test_a_full_queue_refuses_at_once_and_a_long_wait_times_out():
    async def run():
        cap, queue = Capacity(), PlacementQueue(1, 0.1, 0.01)
        first = asyncio.create_task(queue.place(cap.attempt("a")))
        await asyncio.sleep(0.02)
        refused = await queue.place(cap.attempt("b"))
        assert isinstance(refused, Rejection) and refused.reason == "queue_full"
        timed_out = await first
        assert isinstance(timed_out, Rejection) and timed_out.reason == "queue_timeout"
        assert (queue.num_full, queue.num_timed_out, len(queue)) == (1, 1, 0)
    asyncio.run(run())


def test_a_cancelled_waiter_leaves_the_queue():
    async def run():
        cap, queue = Capacity(), PlacementQueue(2, 5.0, 0.01)
        task = asyncio.create_task(queue.place(cap.attempt("a")))
        await asyncio.sleep(0.03)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(queue) == 0
    asyncio.run(run())
