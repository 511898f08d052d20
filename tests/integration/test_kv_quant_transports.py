"""Quantized KV blocks (int8 / fp8 values with their scales inside the block) over real UCX and Redis:
bit-exact round trips, the dequantized values unchanged, and int8 vs unquantized layouts refused."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

from pdserve.kernels.kv_quant import SCALE_LAYOUT, dequantized_cache, store_quantized
from pdserve.kvcache import KVLayout, KVPoolIO, LayoutMismatch
from pdserve.kvcache.quant import quantized_views
from pdserve.kvcache.transports import create_transport
from pdserve.kvcache.transports.ucx import UCXConfig, apply_ucx_env

NUM_BLOCKS = 12
SRC_IDS = [5, 1, 7, 3]
DST_IDS = [0, 2, 4, 6]
SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


def _layout(kv_cache_dtype: str) -> KVLayout:
    dtype = {"int8": "int8", "fp8_e4m3": "float8_e4m3fn"}[kv_cache_dtype]
    return KVLayout("quant-test", dtype, **SHAPE, scale_layout=SCALE_LAYOUT)


def _pool(kv_cache_dtype: str, seed: int) -> tuple[KVPoolIO, list]:
    layout = _layout(kv_cache_dtype)
    pool = torch.zeros(NUM_BLOCKS, layout.block_nbytes, dtype=torch.uint8)
    caches = quantized_views(pool, SHAPE["num_layers"], SHAPE["block_size"], SHAPE["num_kv_heads"],
                             SHAPE["head_dim"], kv_cache_dtype)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.arange(NUM_BLOCKS).repeat_interleave(SHAPE["block_size"])
    offsets = torch.arange(SHAPE["block_size"]).repeat(NUM_BLOCKS)
    for layer in caches:
        for cache in layer:
            x = torch.randn(len(blocks), SHAPE["num_kv_heads"], SHAPE["head_dim"], generator=gen) * 3
            store_quantized(x, cache, blocks, offsets)
    return KVPoolIO(pool), caches


def _assert_blocks_equal(src, src_caches, dst, dst_caches) -> None:
    assert torch.equal(dst.kv_pool[DST_IDS], src.kv_pool[SRC_IDS])
    for (sk, sv), (dk, dv) in zip(src_caches, dst_caches):
        for s, d in ((sk, dk), (sv, dv)):
            assert torch.equal(dequantized_cache(d)[DST_IDS], dequantized_cache(s)[SRC_IDS])
            assert torch.equal(d.scale[DST_IDS], s.scale[SRC_IDS])
    untouched = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
    assert not torch.equal(dst.kv_pool[untouched], src.kv_pool[untouched])  # only the pulled blocks moved


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_blocks_round_trip_bit_exact_over_ucx(kv_cache_dtype):
    apply_ucx_env(UCXConfig())
    pytest.importorskip("ucxx")
    layout = _layout(kv_cache_dtype)
    (src, src_caches), (dst, dst_caches) = _pool(kv_cache_dtype, 1), _pool(kv_cache_dtype, 2)

    async def main():
        released = []

        async def release(lease_id):
            released.append(lease_id)

        exporter = create_transport("ucx", src, layout, release, timeout_s=5.0)
        importer = create_transport("ucx", dst, layout, timeout_s=5.0)
        await exporter.start()
        try:
            params = await exporter.export(uuid.uuid4().hex, SRC_IDS, [11, 12, 13], 15)
            await importer.pull(params, DST_IDS)
            assert importer.bytes_pulled > len(SRC_IDS) * layout.block_nbytes
        finally:
            await importer.close()
            await exporter.close()

    asyncio.run(main())
    _assert_blocks_equal(src, src_caches, dst, dst_caches)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_quantized_blocks_round_trip_bit_exact_over_redis(redis_server, kv_cache_dtype):
    layout = _layout(kv_cache_dtype)
    (src, src_caches), (dst, dst_caches) = _pool(kv_cache_dtype, 3), _pool(kv_cache_dtype, 4)
    prefix = f"pdkv-quant-{uuid.uuid4().hex[:12]}"

    async def main():
        exporter = create_transport("redis", src, layout, None, url=redis_server.url, key_prefix=prefix)
        importer = create_transport("redis", dst, layout, None, url=redis_server.url, key_prefix=prefix)
        try:
            params = await exporter.export(uuid.uuid4().hex, SRC_IDS, [], 15)
            await importer.pull(params, DST_IDS)
            assert importer.bytes_pulled > len(SRC_IDS) * layout.block_nbytes
        finally:
            await importer.close()
            await exporter.close()

    asyncio.run(main())
    _assert_blocks_equal(src, src_caches, dst, dst_caches)


def test_int8_blocks_are_refused_by_a_bf16_pool_over_redis(redis_server):
    int8 = _layout("int8")
    bf16 = KVLayout("quant-test", "bfloat16", **SHAPE)
    src, _ = _pool("int8", 5)
    dst = KVPoolIO(torch.zeros(NUM_BLOCKS, 2, 2, 4, 2, 8, dtype=torch.bfloat16))
    prefix = f"pdkv-quant-{uuid.uuid4().hex[:12]}"

    async def main():
        exporter = create_transport("redis", src, int8, None, url=redis_server.url, key_prefix=prefix)
        importer = create_transport("redis", dst, bf16, None, url=redis_server.url, key_prefix=prefix)
        try:
            params = await exporter.export(uuid.uuid4().hex, SRC_IDS, [], 15)
            with pytest.raises(LayoutMismatch):
                await importer.pull(params, DST_IDS)
        finally:
            await importer.close()
            await exporter.close()

    asyncio.run(main())
    assert dst.kv_pool.count_nonzero() == 0
