"""The UCX transport's plumbing: bounded endpoint pools, grouped UCX operations, and the block runs
that travel as single messages (a run is consecutive in both the exporter's and the importer's pool)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

import torch

from pdserve.kvcache.pool import KVPoolIO


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


async def all_of(operations: list[Awaitable[Any]]) -> list[Any]:
    """Runs UCX operations together; if one fails or the wait is cancelled, the others are cancelled too."""
    tasks = [asyncio.ensure_future(op) for op in operations]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


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
