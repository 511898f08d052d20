"""Where a block lives in the Redis store, and how much of a hash chain the store holds (no torch: the
kvstore service imports this)."""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis


def block_key(prefix: str, layout_hash: int, block_hash: int) -> str:
    return f"{prefix}:{layout_hash:016x}:{block_hash:016x}"


async def stored_prefix_length(
    client: aioredis.Redis, key_prefix: str, layout_hash: int, block_hashes: Sequence[int], batch_blocks: int = 64
) -> int:
    """How many leading blocks of a hash chain the store holds (pipelined EXISTS, a batch at a time,
    stopping at the first batch with a miss). Raises redis errors as they come."""
    num_present = 0
    for start in range(0, len(block_hashes), batch_blocks):
        async with client.pipeline(transaction=False) as pipe:
            for h in block_hashes[start : start + batch_blocks]:
                pipe.exists(block_key(key_prefix, layout_hash, h))
            found = await pipe.execute()
        for is_present in found:
            if not is_present:
                return num_present
            num_present += 1
    return num_present
