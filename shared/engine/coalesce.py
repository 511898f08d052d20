"""Coalesced token streams: everything produced since the consumer last took, as one delta or one batch.

When the consumer keeps up, each batch is one item and nothing waits on a timer; when it lags,
batches grow, so each hop downstream carries fewer, larger messages. `interval_s` > 0 caps the
rate instead (a batch at most every interval after the first), for comparison with fixed-interval
streaming.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from pdserve.engine.outputs import TokenDelta

T = TypeVar("T")


def _concat(a: tuple | None, b: tuple | None) -> tuple | None:
    if a is None and b is None:
        return None
    return (a or ()) + (b or ())


def merge_deltas(deltas: Sequence[TokenDelta]) -> TokenDelta:
    """One delta equal to `deltas` in order: tokens, text and logprobs joined; the end state of the last;
    the once-only fields (queue time, cached tokens, handoff, prompt logprobs) of the first that has them."""
    merged = deltas[0]
    for d in deltas[1:]:
        merged = dataclasses.replace(
            d,
            token_ids=merged.token_ids + d.token_ids, text=merged.text + d.text,
            logprobs=_concat(merged.logprobs, d.logprobs), top_logprobs=_concat(merged.top_logprobs, d.top_logprobs),
            num_cached_tokens=max(merged.num_cached_tokens, d.num_cached_tokens),
            kv_handoff=merged.kv_handoff or d.kv_handoff,
            queue_time_s=merged.queue_time_s if merged.queue_time_s is not None else d.queue_time_s,
            num_prefill_chunks=max(merged.num_prefill_chunks, d.num_prefill_chunks),
            prompt_logprobs=merged.prompt_logprobs if merged.prompt_logprobs is not None else d.prompt_logprobs,
            prompt_top_logprobs=(merged.prompt_top_logprobs if merged.prompt_top_logprobs is not None
                                 else d.prompt_top_logprobs),
        )
    return merged


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
