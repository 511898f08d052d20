"""The UCX transport's plumbing: bounded endpoint pools, posted UCX operations, and the block runs
that travel as single messages (a run is consecutive in both the exporter's and the importer's pool)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import torch

from pdserve.kvcache.pool import KVPoolIO

logger = logging.getLogger(__name__)


class EndpointPool:
    """At most `limit` connections to one peer; idle ones are reused, broken ones dropped."""

    def __init__(self, limit: int) -> None:
        self.slots = asyncio.Semaphore(limit)
        self.idle: list[Any] = []
        self.busy: set[Any] = set()
        self.num_created = 0

    def take_idle(self) -> Any | None:
        while self.idle:
            ep = self.idle.pop()
            if not ep.closed:
                return ep
            ep.abort()
        return None

    def put(self, ep: Any, reusable: bool) -> None:
        self.busy.discard(ep)
        if reusable and not ep.closed:
            self.idle.append(ep)
        else:
            ep.abort()  # cancels its posted receives: nothing lands in the pool after this
        self.slots.release()

    def close(self) -> None:
        for ep in [*self.idle, *self.busy]:
            ep.abort()  # an in-flight pull on a busy one fails at once
        self.idle.clear()


class PostedOps:
    """UCX operations posted on one endpoint, each holding the buffer it reads or writes.

    UCX writes into a receive buffer until the operation ends, and cancelling the asyncio side does
    not end it (a Python buffer freed meanwhile is heap corruption: a client leaving mid-pull used to
    segfault the decode replica). So waits here never cancel an operation: `wait` shields them, and
    after a failure or cancellation `settle` aborts the endpoint (which ends every posted operation
    with an error) and waits until each has ended, holding its buffer until then.
    """

    def __init__(self, ep: Any) -> None:
        self.ep = ep
        self.ops: list[asyncio.Future] = []

    def post(self, operation: Awaitable[Any]) -> asyncio.Future:
        future = asyncio.ensure_future(operation)
        self.ops.append(future)
        return future

    @staticmethod
    def wait(*futures: asyncio.Future) -> Awaitable[list[Any]]:
        """All of `futures`; cancelling (or timing out) this wait leaves the operations running."""
        together = asyncio.gather(*futures)
        together.add_done_callback(_retrieve)
        return asyncio.shield(together)

    async def settle(self, timeout_s: float) -> list[asyncio.Future]:
        """Aborts the endpoint if an operation is still posted and waits for all of them; returns those
        still posted after `timeout_s` (their buffers must then be kept for good)."""
        pending = [op for op in self.ops if not op.done()]
        still: set[asyncio.Future] = set()
        if pending:
            self.ep.abort()
            _, still = await asyncio.wait(pending, timeout=timeout_s)
        for op in self.ops:
            if op.done():
                _retrieve(op)
        return list(still)


class OperationKeeper:
    """Holds failed and abandoned UCX work until UCX lets go of it: settles in flight (a second
    cancellation of their caller must not drop the buffers they hold), operations UCX never ended (their
    buffers stay alive for good), and connects whose caller left (aborted once they land)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pending: set[asyncio.Future] = set()
        self._stranded: list[asyncio.Future] = []

    async def settle(self, ops: PostedOps) -> None:
        """After a failure or cancellation: wait until every operation posted on the endpoint has ended."""
        settle = asyncio.ensure_future(ops.settle(self.timeout_s))
        self._pending.add(settle)
        settle.add_done_callback(self._settled)
        try:
            await asyncio.shield(settle)
        except asyncio.CancelledError:
            pass  # the caller re-raises its own failure

    def abandon_connect(self, connect: asyncio.Future) -> None:
        self._pending.add(connect)
        connect.add_done_callback(self._connected)

    def _connected(self, connect: asyncio.Future) -> None:
        self._pending.discard(connect)
        if not connect.cancelled() and connect.exception() is None:
            connect.result().abort()

    def _settled(self, settle: asyncio.Future) -> None:
        self._pending.discard(settle)
        stranded = [] if settle.cancelled() or settle.exception() else settle.result()
        if stranded:
            self._stranded.extend(stranded)
            logger.error("%d UCX operations did not end after their endpoint was aborted", len(stranded))


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # an expected failure once the endpoint is aborted: retrieved, not logged


def span(pool: KVPoolIO, first: int, count: int) -> Any:
    """`count` consecutive pool blocks as one byte buffer aliasing the pool (numpy on host, CUDA tensor)."""
    pool.block_tensor(first + count - 1)
    flat = pool.kv_pool.narrow(0, first, count).reshape(-1).view(torch.uint8)  # [count * block_nbytes]
    return flat.numpy() if pool.is_host else flat


def segments_of(src: tuple[int, ...], dst: list[int]) -> list[tuple[int, int]]:
    """(start index, length) of the maximal runs consecutive in both block id lists."""
    segments: list[tuple[int, int]] = []
    for i in range(len(src)):
        if segments and src[i] == src[i - 1] + 1 and dst[i] == dst[i - 1] + 1:
            start, count = segments[-1]
            segments[-1] = (start, count + 1)
        else:
            segments.append((i, 1))
    return segments


def dest_runs(dst: list[int], segments: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [(dst[start], count) for start, count in segments]


def runs_of(block_ids: tuple[int, ...], lengths: list[int]) -> list[tuple[int, int]] | None:
    """(first block id, count) per requested segment, or None if a segment is not consecutive here."""
    if any(n <= 0 for n in lengths) or sum(lengths) != len(block_ids):
        return None
    runs, start = [], 0
    for n in lengths:
        chunk = block_ids[start : start + n]
        if any(b != chunk[0] + k for k, b in enumerate(chunk)):
            return None
        runs.append((chunk[0], n))
        start += n
    return runs
