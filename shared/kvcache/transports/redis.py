"""Redis (or Valkey) KV transport: blocks go through a shared store under content-addressed keys.

Key `{prefix}:{layout_hash:016x}:{block_hash:016x}` holds one block as a self-describing one-block
wire payload (header + bytes), so the reader checks layout, size and checksum before its pool is
touched. Full blocks are keyed by their chained prefix hash and shared across requests (SET NX);
blocks without one (the trailing partial block) by a hash of their bytes and predecessor's key.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions
import xxhash
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from pdserve.kvcache import wire
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.redis_keys import block_key, stored_prefix_length
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports.base import KVTransferError, KVTransport, ReleaseFn

_PARTIAL_TAG = b"pdkv-partial-block\0"


@dataclass
class RedisTransportStats:
    blocks_written: int = 0  # SET NX stored a new value
    blocks_skipped: int = 0  # SET NX found the key present: the block was already in the store
    blocks_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


def redact_url(url: str) -> str:
    """The URL with its password replaced by ***, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def partial_block_hash(prev_hash: int, block: memoryview | bytes) -> int:
    """Content address of a block that has no chained hash (not prefix-cacheable).

    Derived from the bytes themselves, so two exporters can never publish different data under one
    key (a lease id is only unique within one worker).
    """
    digest = xxhash.xxh3_64(_PARTIAL_TAG + struct.pack("<Q", prev_hash))
    digest.update(block)
    return digest.intdigest()


class RedisTransport(KVTransport):
    """Exporter copies a lease's blocks into Redis and releases the lease; importers pull by key.

    Values expire after `ttl_s`. `lookup_prefix` tells a router how much of a chain is stored.
    """

    name = "redis"

    def __init__(
        self,
        pool: KVPoolIO,
        layout: KVLayout,
        release: ReleaseFn | None = None,
        *,
        url: str = "redis://127.0.0.1:6379/0",
        ttl_s: int = 600,
        batch_blocks: int = 64,
        key_prefix: str = "pdkv",
        socket_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(pool, layout, release)
        if ttl_s <= 0 or batch_blocks <= 0 or socket_timeout_s <= 0:
            raise ValueError("ttl_s, batch_blocks and socket_timeout_s must be positive")
        if pool.block_nbytes != layout.block_nbytes:
            raise ValueError(f"pool blocks are {pool.block_nbytes} bytes, layout says {layout.block_nbytes}")
        self.url = url
        self.safe_url = redact_url(url)
        self.ttl_s = int(ttl_s)
        self.batch_blocks = batch_blocks
        self.key_prefix = key_prefix
        self.stats = RedisTransportStats()
        # Few, short retries: a dead store must surface as KVTransferError in seconds, not minutes.
        self.client = aioredis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2),
        )

    async def start(self) -> None:
        """Check that the store is reachable and accepts our credentials."""
        with self._redis_errors("connect"):
            await self.client.ping()

    async def close(self) -> None:
        await self.settle_releases()
        await self.client.aclose()

    async def export(
        self, lease_id: str, block_ids: list[int], block_hashes: list[int], num_tokens: int
    ) -> HandoffParams:
        block_size = self.layout.block_size
        if len(block_hashes) > len(block_ids):
            raise ValueError(f"{len(block_hashes)} block hashes for {len(block_ids)} blocks")
        if not len(block_hashes) * block_size <= num_tokens <= len(block_ids) * block_size:
            raise ValueError(f"{num_tokens} tokens do not fit {len(block_ids)} blocks of {block_size}")
        layout_hash = self.layout.layout_hash
        hashes = [int(h) for h in block_hashes]  # grows by one derived hash per unhashed block
        with self._redis_errors(f"export of lease {lease_id!r}"):
            for start in range(0, len(block_ids), self.batch_blocks):
                blocks = self.pool.read_blocks(block_ids[start : start + self.batch_blocks])
                sizes = []
                async with self.client.pipeline(transaction=False) as pipe:
                    for index, block in enumerate(blocks, start):
                        if index == len(hashes):
                            hashes.append(partial_block_hash(hashes[-1] if hashes else 0, block))
                        value = self._encode(layout_hash, hashes[index], block)
                        sizes.append(len(value))
                        key = block_key(self.key_prefix, layout_hash, hashes[index])
                        pipe.set(key, value, ex=self.ttl_s, nx=True)
                        pipe.expire(key, self.ttl_s)  # a skipped block must not expire before the pull
                    stored = (await pipe.execute())[0::2]
                num_stored = sum(1 for is_new in stored if is_new)
                self.stats.blocks_written += num_stored
                self.stats.blocks_skipped += len(stored) - num_stored
                self.stats.bytes_written += sum(n for n, is_new in zip(sizes, stored) if is_new)
        self.release_soon(lease_id)  # the blocks now live in the store; the first token need not wait for the engine
        return HandoffParams(
            transport=self.name,
            layout_hash=layout_hash,
            lease_id=lease_id,
            num_tokens=num_tokens,
            block_ids=tuple(block_ids),
            block_hashes=tuple(hashes),
        )

    async def pull(self, params: HandoffParams, dest_block_ids: list[int]) -> None:
        """Fill dest blocks batch by batch; every block of a batch is verified before any is written.

        On error, earlier batches may already sit in their (reserved) destination blocks.
        """
        self._check_pull(params, dest_block_ids)
        if len(params.block_hashes) != len(params.block_ids):
            raise ValueError(
                f"a redis handoff needs one content address per block: "
                f"{len(params.block_hashes)} hashes for {len(params.block_ids)} blocks"
            )
        self.bytes_pulled += await self._fetch(
            params.layout_hash, params.block_hashes, dest_block_ids, f"lease {params.lease_id!r}")

    async def pull_prefix(self, layout_hash: int, block_hashes: Sequence[int], dest_block_ids: list[int]) -> None:
        """Fill dest blocks with the stored blocks of a prompt's hash chain (the cross-instance prefix
        cache), verified like `pull`: layout, hash and checksum of every block before it is written."""
        self.layout.check_compatible(layout_hash)
        if len(block_hashes) != len(dest_block_ids):
            raise ValueError(f"{len(block_hashes)} block hashes for {len(dest_block_ids)} destination blocks")
        self.bytes_pulled += await self._fetch(layout_hash, block_hashes, dest_block_ids, "prefix")

    async def _fetch(self, layout_hash: int, block_hashes: Sequence[int], dest_block_ids: list[int], what: str) -> int:
        nbytes = 0
        for start in range(0, len(dest_block_ids), self.batch_blocks):
            hashes = block_hashes[start : start + self.batch_blocks]
            keys = [block_key(self.key_prefix, layout_hash, h) for h in hashes]
            with self._redis_errors(f"pull of {what}"):
                values = await self.client.mget(keys)
            payloads = [
                self._decode(start + i, keys[i], hashes[i], value, layout_hash, what)
                for i, value in enumerate(values)
            ]
            for block_id, payload in zip(dest_block_ids[start : start + self.batch_blocks], payloads):
                self.pool.write_block(block_id, payload)
            self.stats.blocks_read += len(payloads)
            self.stats.bytes_read += sum(len(v) for v in values)
            nbytes += sum(len(v) for v in values)
        return nbytes

    async def lookup_prefix(self, layout_hash: int, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain are stored (the prefix a puller would find)."""
        with self._redis_errors("prefix lookup"):
            return await stored_prefix_length(self.client, self.key_prefix, layout_hash, block_hashes,
                                              self.batch_blocks)

    def _encode(self, layout_hash: int, block_hash: int, block: memoryview) -> bytes:
        header = wire.encode_header(layout_hash, self.layout.block_nbytes, [block_hash], [block])
        return b"".join((header, block))

    def _decode(
        self, index: int, key: str, block_hash: int, value: bytes | None, layout_hash: int, what: str
    ) -> memoryview:
        where = f"KV block {index} of {what} (key {key})"
        if value is None:
            raise KVTransferError(f"{where} is missing from Redis at {self.safe_url}: expired or evicted")
        view = memoryview(value)
        try:
            header = wire.decode_header(view, layout_hash, self.layout.block_nbytes, max_blocks=1)
            if header.block_hashes != (block_hash,):
                raise wire.WireError(f"value holds blocks {[f'{h:016x}' for h in header.block_hashes]}")
            payload = view[header.nbytes :]
            if payload.nbytes != header.block_nbytes:
                kind = "truncated" if payload.nbytes < header.block_nbytes else "oversized"
                raise wire.WireError(
                    f"{kind} value: {payload.nbytes} payload bytes, expected {header.block_nbytes}"
                )
            wire.verify_blocks(header, [payload])
        except wire.WireError as e:
            raise wire.WireError(f"{where}: {e}") from e
        return payload

    @contextlib.contextmanager
    def _redis_errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except redis.exceptions.AuthenticationError as e:
            raise KVTransferError(
                f"Redis authentication failed at {self.safe_url} during {action}: {e} "
                "(check the user and password in the URL)"
            ) from e
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
            raise KVTransferError(
                f"Redis at {self.safe_url} unreachable during {action}: {type(e).__name__}: {e}"
            ) from e
        except redis.exceptions.RedisError as e:
            raise KVTransferError(
                f"Redis at {self.safe_url} failed during {action}: {type(e).__name__}: {e}"
            ) from e
