"""The Redis tier as a cross-instance prefix cache, on the worker side.

Before a prompt is admitted, the worker pulls the leading blocks of its hash chain that its own pool
misses from Redis into the prefix cache (`BlockManager.cache_blocks`), so the engine's prefix match
hits them. How many leading blocks to take is the router's call (`WorkerRequest.prefix_pull_blocks`):
it found them in the store and its latency model says pulling beats recomputing. Every block is
verified (layout, hash, checksum) before it enters the pool. A failure (store down, a block expired
or evicted, a corrupt value, no free blocks) pulls nothing: the prompt is recomputed, and the
outcome says why so the caller counts it.
"""

from __future__ import annotations

import asyncio

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.kvcache.layout import LayoutMismatch
from pdserve.kvcache.transports.base import KVTransferError, KVTransport
from pdserve.kvcache.transports.redis import RedisTransport
from pdserve.kvcache.wire import WireError
from pdserve.prefix_hash import prompt_block_hashes


@dataclass(frozen=True)
class PrefixPull:
    block_size: int
    num_local_blocks: int = 0  # leading blocks the pool already held
    num_pulled_blocks: int = 0  # the blocks after those, now in the prefix cache
    failure: str | None = None  # why nothing was pulled: "transfer_failed" | "corrupt_payload" | ...
    error: str | None = None

    def hit_sources(self, num_cached_tokens: int) -> dict[str, int]:
        """The engine's prefix hit (tokens) by where its blocks came from: pulled blocks count as
        `redis` only where the hit reached them (they may have been evicted before admission)."""
        local_end = self.num_local_blocks * self.block_size
        redis = min(self.num_pulled_blocks * self.block_size, max(0, num_cached_tokens - local_end))
        return {"local": num_cached_tokens - redis, "redis": redis}


class PrefixPuller:
    def __init__(self, engine: AsyncLLMEngine, transport: RedisTransport) -> None:
        self.engine = engine
        self.transport = transport
        self.block_size = transport.layout.block_size

    @classmethod
    def over(cls, engine: AsyncLLMEngine, transport: KVTransport) -> PrefixPuller | None:
        """A puller over a worker's KV transport when it is the Redis tier's; None otherwise."""
        return cls(engine, transport) if isinstance(transport, RedisTransport) else None

    async def pull(self, prompt_token_ids: Sequence[int], num_blocks: int) -> PrefixPull:
        """Pull the prompt's first `num_blocks` blocks that the pool misses (never the block holding the
        last prompt token, which is always computed)."""
        hashes = prompt_block_hashes(prompt_token_ids, self.block_size)[:max(0, num_blocks)]
        local = self.engine.kv_events.num_leading_held(hashes)
        missing = list(hashes[local:])
        if not missing:
            return PrefixPull(self.block_size, local)
        try:
            lease = await self.engine.reserve_kv(len(missing) * self.block_size)
        except MemoryError as exc:
            return PrefixPull(self.block_size, local, failure="no_kv_capacity", error=str(exc))
        try:
            await self.transport.pull_prefix(self.transport.layout.layout_hash, missing, list(lease.block_ids))
        except BaseException as exc:  # a cancel included: shielded, so a second cancel cannot skip it
            await asyncio.shield(self.engine.release_lease(lease.lease_id))
            failure = _failure(exc)
            if failure is None:
                raise
            return PrefixPull(self.block_size, local, failure=failure, error=f"{type(exc).__name__}: {exc}")
        # shielded: a cancel while a step holds the engine would leave the filled lease held until it expires
        await asyncio.shield(self.engine.cache_lease(lease.lease_id, missing))
        return PrefixPull(self.block_size, local, len(missing))


def _failure(exc: BaseException) -> str | None:
    if isinstance(exc, LayoutMismatch):
        return "layout_mismatch"
    if isinstance(exc, WireError):
        return "corrupt_payload"
    if isinstance(exc, (KVTransferError, TimeoutError, OSError)):
        return "transfer_failed"
    return None
