"""The store's logic, independent of Ray: prefix lookup over content-addressed block keys, policy, stats.

Keys are `{prefix}:{layout_hash:016x}:{block_hash:016x}` (the same keys the redis KV transport
writes), so a chain of block hashes is stored exactly when each of its keys exists.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pdserve.kvcache.redis_keys import block_key, stored_prefix_length
from pdserve.runtime.redis_health import apply_settings, redact_url, redis_settings
from pdserve.services.kvstore.config import KVStoreConfig

__all__ = ["KVStore", "KVStoreUnavailable", "block_key"]


class KVStoreUnavailable(RuntimeError):
    """Redis cannot be reached; callers treat every lookup as a miss."""


class KVStore:
    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self.client = aioredis.from_url(
            config.redis_url, socket_timeout=config.socket_timeout_s, socket_connect_timeout=config.socket_timeout_s
        )
        self.num_lookups = 0
        self.num_lookup_blocks = 0
        self.num_hit_blocks = 0

    async def apply_policy(self) -> None:
        """Sets maxmemory / maxmemory-policy and reads them back: RedisSettingsError if Redis refuses or does
        not keep them, KVStoreUnavailable if it cannot be reached."""
        settings = redis_settings(self.config.maxmemory_bytes, self.config.maxmemory_policy)
        try:
            await apply_settings(self.client, settings, redact_url(self.config.redis_url))
        except RedisError as exc:
            raise KVStoreUnavailable(self._explain(exc)) from exc

    async def lookup_prefix(self, layout_hash: int, block_hashes: list[int]) -> int:
        """Number of leading blocks of the chain present in the store."""
        self.num_lookups += 1
        self.num_lookup_blocks += len(block_hashes)
        if not block_hashes:
            return 0
        try:
            hits = await stored_prefix_length(self.client, self.config.key_prefix, layout_hash, block_hashes)
        except RedisError as exc:
            raise KVStoreUnavailable(self._explain(exc)) from exc
        self.num_hit_blocks += hits
        return hits

    async def stats(self) -> dict[str, Any]:
        try:
            memory = await self.client.info("memory")
            counters = await self.client.info("stats")
            keyspace = await self.client.dbsize()
        except RedisError as exc:
            raise KVStoreUnavailable(self._explain(exc)) from exc
        return {
            "used_memory_bytes": int(memory.get("used_memory", 0)),
            "maxmemory_bytes": int(memory.get("maxmemory", 0)),
            "maxmemory_policy": memory.get("maxmemory_policy"),
            "num_keys": int(keyspace),
            "evicted_keys": int(counters.get("evicted_keys", 0)),
            "expired_keys": int(counters.get("expired_keys", 0)),
            "ttl_s": self.config.ttl_s,
            "lookups": self.num_lookups,
            "lookup_blocks": self.num_lookup_blocks,
            "hit_blocks": self.num_hit_blocks,
        }

    async def is_healthy(self) -> bool:
        try:
            return bool(await self.client.ping())
        except RedisError:
            return False

    async def close(self) -> None:
        await self.client.aclose()

    def _explain(self, exc: Exception) -> str:
        from redis.connection import parse_url

        where = parse_url(self.config.redis_url)
        return f"redis at {where.get('host')}:{where.get('port')} unavailable: {exc}"
