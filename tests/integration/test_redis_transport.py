"""RedisTransport against a real Redis-protocol server: bit-exact handoff, dedupe, and every refusal."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import pytest
import redis
import torch

from pdserve.kvcache import HandoffParams, KVLayout, KVPoolIO, LayoutMismatch, WireError
from pdserve.kvcache.transports import KVTransferError, create_transport
from pdserve.kvcache.transports.redis import RedisTransport, block_key, redact_url

T = TypeVar("T")
NUM_BLOCKS = 12
BLOCK_SIZE = 4
SRC_BLOCKS = [5, 1, 7, 3]  # 3 full blocks and a partial one
DEST_BLOCKS = [0, 2, 4, 6]
NUM_TOKENS = 3 * BLOCK_SIZE + 2


def make_layout(dtype: str = "float32", fingerprint: str = "test-model") -> KVLayout:
    return KVLayout(fingerprint, dtype, num_layers=2, num_kv_heads=2, head_dim=8, block_size=BLOCK_SIZE)


def make_pool(layout: KVLayout, seed: int) -> KVPoolIO:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return KVPoolIO(torch.randn(shape, generator=gen).to(getattr(torch, layout.dtype)))


def chain(seed: int, n: int = 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def snapshot(pool: KVPoolIO) -> torch.Tensor:
    return pool.kv_pool.clone()


def assert_same_blocks(src: KVPoolIO, src_ids: list[int], dest: KVPoolIO, dest_ids: list[int]) -> None:
    for s, d in zip(src_ids, dest_ids):
        assert torch.equal(src.block_tensor(s), dest.block_tensor(d)), f"block {s} -> {d} differs"


class Harness:
    """Builds transports that share a fresh key prefix and closes them when `run` ends."""

    def __init__(self, server) -> None:
        self.server = server
        self.prefix = f"pdkv-test-{uuid.uuid4().hex[:12]}"  # keeps tests apart, also on a shared REDIS_URL
        self.opened: list[RedisTransport] = []

    def transport(self, pool: KVPoolIO, layout: KVLayout, **kwargs) -> RedisTransport:
        kwargs.setdefault("url", self.server.url)
        t = create_transport("redis", pool, layout, kwargs.pop("release", None), key_prefix=self.prefix, **kwargs)
        self.opened.append(t)
        return t

    def run(self, main: Callable[[], Awaitable[T]]) -> T:
        async def closing() -> T:
            try:
                return await main()
            finally:
                for t in self.opened:
                    await t.close()
                self.opened.clear()

        return asyncio.run(closing())


@pytest.fixture
def h(redis_server) -> Harness:
    return Harness(redis_server)


@pytest.fixture
def raw(redis_server) -> Iterator[redis.Redis]:
    client = redis_server.client()
    yield client
    client.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bit_exact(h, raw, dtype):
    layout = make_layout(dtype)
    pool_a, pool_b = make_pool(layout, 1), make_pool(layout, 2)
    hashes = chain(1)
    released: list[str] = []

    async def release(lease_id: str) -> None:
        released.append(lease_id)

    exporter = h.transport(pool_a, layout, release=release, ttl_s=120, batch_blocks=3)
    importer = h.transport(pool_b, layout, batch_blocks=3)
    untouched = snapshot(pool_b)

    async def main():
        await exporter.start()
        params = await exporter.export("lease-1", SRC_BLOCKS, hashes, NUM_TOKENS)
        await exporter.settle_releases()  # released in the background, once the blocks are stored
        assert released == ["lease-1"]
        await importer.pull(params, DEST_BLOCKS)
        return params

    params = h.run(main)
    assert params.transport == "redis" and params.layout_hash == layout.layout_hash
    assert params.block_ids == tuple(SRC_BLOCKS) and params.num_tokens == NUM_TOKENS
    assert len(params.block_hashes) == len(SRC_BLOCKS) and params.block_hashes[:3] == tuple(hashes)
    assert_same_blocks(pool_a, SRC_BLOCKS, pool_b, DEST_BLOCKS)
    others = [b for b in range(NUM_BLOCKS) if b not in DEST_BLOCKS]
    assert torch.equal(pool_b.kv_pool[others], untouched[others])
    assert (exporter.stats.blocks_written, exporter.stats.blocks_skipped) == (4, 0)
    assert importer.stats.blocks_read == 4 and importer.stats.bytes_read == exporter.stats.bytes_written
    assert 0 < raw.ttl(block_key(h.prefix, layout.layout_hash, params.block_hashes[-1])) <= 120


def test_handoff_params_survive_a_dict_round_trip(h):
    layout = make_layout()
    pool_a, pool_b = make_pool(layout, 3), make_pool(layout, 4)
    exporter, importer = h.transport(pool_a, layout), h.transport(pool_b, layout)

    async def main():
        params = await exporter.export("lease-d", SRC_BLOCKS, chain(3), NUM_TOKENS)
        await importer.pull(HandoffParams.from_dict(params.to_dict()), DEST_BLOCKS)

    h.run(main)
    assert_same_blocks(pool_a, SRC_BLOCKS, pool_b, DEST_BLOCKS)


def test_full_blocks_are_deduplicated_and_ttl_refreshed(h, raw):
    layout = make_layout()
    pool = make_pool(layout, 5)
    hashes = chain(5)
    first_key = block_key(h.prefix, layout.layout_hash, hashes[0])
    exporter = h.transport(pool, layout, ttl_s=300)
    stats = exporter.stats

    async def main():
        await exporter.export("lease-1", SRC_BLOCKS, hashes, NUM_TOKENS)
        assert (stats.blocks_written, stats.blocks_skipped) == (4, 0)
        raw.expire(first_key, 5)
        # Same 3-block prefix, another tail: only the partial block is new.
        await exporter.export("lease-2", SRC_BLOCKS[:3] + [9], hashes, NUM_TOKENS)
        assert (stats.blocks_written, stats.blocks_skipped) == (5, 3)
        # The same content again: the partial block is content-addressed, so it dedupes too.
        await exporter.export("lease-3", SRC_BLOCKS, hashes, NUM_TOKENS)
        assert (stats.blocks_written, stats.blocks_skipped) == (5, 7)

    h.run(main)
    assert raw.ttl(first_key) > 5, "a skipped block keeps its old TTL and may expire before the pull"


def test_layout_mismatch_is_refused_and_pool_unchanged(h):
    layout, other = make_layout(), make_layout(fingerprint="another-model")
    assert layout.block_nbytes == other.block_nbytes
    pool_a, pool_b = make_pool(layout, 6), make_pool(other, 7)
    exporter, importer = h.transport(pool_a, layout), h.transport(pool_b, other)
    before = snapshot(pool_b)

    async def main():
        params = await exporter.export("l", SRC_BLOCKS, chain(6), NUM_TOKENS)
        with pytest.raises(LayoutMismatch):
            await importer.pull(params, DEST_BLOCKS)

    h.run(main)
    assert torch.equal(pool_b.kv_pool, before)


def export_tamper_pull(h, raw, tamper) -> Exception:
    """Export 4 blocks, rewrite block 2's value with tamper(key), pull; check the pool is unchanged."""
    layout = make_layout()
    pool_a, pool_b = make_pool(layout, 8), make_pool(layout, 9)
    exporter, importer = h.transport(pool_a, layout), h.transport(pool_b, layout)
    before = snapshot(pool_b)

    async def main():
        params = await exporter.export("l", SRC_BLOCKS, chain(8), NUM_TOKENS)
        tamper(block_key(h.prefix, layout.layout_hash, params.block_hashes[2]))
        with pytest.raises((WireError, KVTransferError)) as info:
            await importer.pull(params, DEST_BLOCKS)
        return info.value

    error = h.run(main)
    assert torch.equal(pool_b.kv_pool, before), "a refused batch must write nothing"
    return error


@pytest.mark.parametrize("offset", [10, 30, -1], ids=["header", "table", "payload"])
def test_corrupt_value_is_refused(h, raw, offset):
    def flip(key):
        value = bytearray(raw.get(key))
        value[offset] ^= 0x40
        raw.set(key, bytes(value), keepttl=True)

    error = export_tamper_pull(h, raw, flip)
    assert isinstance(error, WireError) and "KV block 2" in str(error)


@pytest.mark.parametrize("keep", [20, -10], ids=["in-header", "in-payload"])
def test_truncated_value_is_refused(h, raw, keep):
    error = export_tamper_pull(h, raw, lambda key: raw.set(key, raw.get(key)[:keep], keepttl=True))
    assert isinstance(error, WireError) and "truncated" in str(error)


def test_value_under_the_wrong_key_is_refused(h, raw):
    first_key = block_key(h.prefix, make_layout().layout_hash, chain(8)[0])
    error = export_tamper_pull(h, raw, lambda key: raw.set(key, raw.get(first_key), keepttl=True))
    assert isinstance(error, WireError) and "KV block 2" in str(error)


@pytest.mark.parametrize("how", ["evicted", "expired"])
def test_missing_block_raises_transfer_error(h, raw, how):
    def remove(key):
        if how == "evicted":
            raw.delete(key)
        else:
            raw.pexpire(key, 1)
            time.sleep(0.02)

    error = export_tamper_pull(h, raw, remove)
    assert isinstance(error, KVTransferError)
    assert "KV block 2" in str(error) and "expired or evicted" in str(error)


def test_store_down_fails_fast_then_recovers(h, redis_server):
    layout = make_layout()
    pool_a, pool_b = make_pool(layout, 10), make_pool(layout, 11)
    released: list[str] = []

    async def release(lease_id: str) -> None:
        released.append(lease_id)

    exporter = h.transport(pool_a, layout, release=release, socket_timeout_s=1.0)
    importer = h.transport(pool_b, layout, socket_timeout_s=1.0)

    async def main():
        params = await exporter.export("before", SRC_BLOCKS, chain(10), NUM_TOKENS)
        redis_server.stop()
        with pytest.raises(KVTransferError, match="unreachable") as info:
            await asyncio.wait_for(importer.pull(params, DEST_BLOCKS), timeout=5)
        assert "127.0.0.1" in str(info.value)
        with pytest.raises(KVTransferError):
            await asyncio.wait_for(exporter.export("during", SRC_BLOCKS, chain(10), NUM_TOKENS), timeout=5)
        await exporter.settle_releases()
        assert released == ["before"], "a failed export must keep its lease"
        redis_server.start()
        params = await exporter.export("after", SRC_BLOCKS, chain(10), NUM_TOKENS)
        await importer.pull(params, DEST_BLOCKS)

    try:
        h.run(main)
    finally:
        redis_server.ensure_running()
    assert_same_blocks(pool_a, SRC_BLOCKS, pool_b, DEST_BLOCKS)


def test_hung_store_times_out(h, redis_server):
    layout = make_layout()
    exporter = h.transport(make_pool(layout, 12), layout, socket_timeout_s=0.3)

    async def main():
        await exporter.start()
        redis_server.pause()
        try:
            with pytest.raises(KVTransferError, match="Timeout"):
                await asyncio.wait_for(exporter.export("l", SRC_BLOCKS, chain(12), NUM_TOKENS), timeout=5)
        finally:
            redis_server.resume()

    h.run(main)


def test_password_protected_server(redis_server_factory):
    server = redis_server_factory(password="s3cret-pw")
    h = Harness(server)
    layout = make_layout()
    pool_a, pool_b = make_pool(layout, 13), make_pool(layout, 14)
    exporter, importer = h.transport(pool_a, layout), h.transport(pool_b, layout)
    wrong = h.transport(pool_b, layout, url=f"redis://:wrong-pw@127.0.0.1:{server.port}/0")
    anonymous = h.transport(pool_b, layout, url=f"redis://127.0.0.1:{server.port}/0")

    async def main():
        await exporter.start()
        params = await exporter.export("l", SRC_BLOCKS, chain(13), NUM_TOKENS)
        await importer.pull(params, DEST_BLOCKS)
        for bad in (wrong, anonymous):
            with pytest.raises(KVTransferError, match="authentication") as info:
                await asyncio.wait_for(bad.start(), timeout=5)
            assert "wrong-pw" not in str(info.value)
            with pytest.raises(KVTransferError, match="authentication"):
                await asyncio.wait_for(bad.pull(params, DEST_BLOCKS), timeout=5)

    h.run(main)
    assert_same_blocks(pool_a, SRC_BLOCKS, pool_b, DEST_BLOCKS)


def test_lookup_prefix_counts_leading_stored_blocks(h, raw):
    layout = make_layout()
    lh = layout.layout_hash
    hashes = chain(15)
    store = h.transport(make_pool(layout, 15), layout, batch_blocks=2)

    async def main():
        assert await store.lookup_prefix(lh, hashes) == 0
        await store.export("l", SRC_BLOCKS, hashes, NUM_TOKENS)
        assert await store.lookup_prefix(lh, hashes) == 3
        assert await store.lookup_prefix(lh, hashes + chain(99, 2)) == 3
        assert await store.lookup_prefix(lh, []) == 0
        assert await store.lookup_prefix(make_layout(fingerprint="other").layout_hash, hashes) == 0
        raw.delete(block_key(h.prefix, lh, hashes[1]))
        assert await store.lookup_prefix(lh, hashes) == 1

    h.run(main)


def test_export_rejects_inconsistent_requests(h):
    layout = make_layout()
    store = h.transport(make_pool(layout, 16), layout)

    async def main():
        with pytest.raises(ValueError):
            await store.export("l", [1, 2], chain(16, 3), 8)  # more hashes than blocks
        with pytest.raises(ValueError):
            await store.export("l", [1, 2], chain(16, 1), 9)  # 9 tokens do not fit 2 blocks of 4

    h.run(main)


def test_redact_url_hides_the_password():
    assert redact_url("redis://user:pw@host:6380/1") == "redis://user:***@host:6380/1"
    assert redact_url("rediss://:pw@host/0") == "rediss://:***@host/0"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"
