"""Regrouping a stream for a consumer that may lag: the first item at once, then everything that
arrived while the consumer was away. When the consumer keeps up each batch is one item and nothing
waits on a timer; when it lags, batches grow, so each hop downstream carries fewer, larger messages.
`interval_s` > 0 caps the rate instead (a batch at most every interval after the first), for
comparison with fixed-interval streaming. No torch here: the router uses it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


async def batches(items: AsyncIterator[T], interval_s: float = 0.0) -> AsyncIterator[list[T]]:
    """`items` regrouped: the first at once, then whatever arrived while the consumer was away.

    A pump task reads `items` ahead into a queue; closing this generator cancels the pump and closes
    `items` (so an abandoned stream still aborts its work upstream). An error from `items` is raised
    after the items that preceded it were delivered.
    """
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump() -> None:
        try:
            async for item in items:
                queue.put_nowait(item)
        except BaseException as exc:  # delivered in order, after what came before it
            queue.put_nowait(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            queue.put_nowait(done)

    task = asyncio.create_task(pump())
    last_flush: float | None = None
    try:
        while True:
            batch = [await queue.get()]
            if interval_s > 0 and last_flush is not None:
                wait = last_flush + interval_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            while not queue.empty():
                batch.append(queue.get_nowait())
            end = next((k for k, item in enumerate(batch) if item is done or isinstance(item, BaseException)), None)
            ready = batch if end is None else batch[:end]
            if ready:
                last_flush = time.monotonic()
                yield ready
            if end is not None:
                if isinstance(batch[end], BaseException):
                    raise batch[end]
                return
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - the pump's own cancellation
                pass
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()
