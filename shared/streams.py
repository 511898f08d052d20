"""Regrouping a stream for a consumer that may lag: the first item at once, then everything that
arrived while the consumer was away. When the consumer keeps up each batch is one item and nothing
waits on a timer; when it lags, batches grow, so each hop downstream carries fewer, larger messages.
`interval_s` > 0 caps the rate instead (a batch at most every interval after the first), for
comparison with fixed-interval streaming. `merged` joins one choice's items of a batch into one.
No torch here: the router uses it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

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


# fields joined across parts, and fields set once (on the first part that has them); the rest is the last's
_JOINED = ("token_ids", "text", "logprobs", "top_logprobs")
_ONCE = ("num_cached_tokens", "kv_handoff", "queue_time_s", "num_prefill_chunks", "prompt_logprobs",
         "prompt_top_logprobs")


def merged(parts: Sequence[T]) -> T:
    """One item equal to `parts` (one choice's consecutive token deltas or batches, in order): tokens, text and
    logprobs joined, the end state of the last, the once-only fields (queue time, cached tokens, handoff,
    prompt logprobs) of the first that has them. Works on the engine's TokenDelta and the contract's TokenBatch."""
    if len(parts) == 1:
        return parts[0]
    names = {f.name for f in dataclasses.fields(parts[-1])}
    changes: dict[str, Any] = {}
    for name in _JOINED:
        values = [getattr(p, name) for p in parts]
        if name == "text":
            changes[name] = "".join(values)
        elif any(v is not None for v in values):
            changes[name] = tuple(x for v in values for x in v or ())
    for name in (n for n in _ONCE if n in names):
        changes[name] = next((v for p in parts if (v := getattr(p, name))), getattr(parts[0], name))
    return dataclasses.replace(parts[-1], **changes)
