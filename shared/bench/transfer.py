"""`pdserve bench transfer`: move one request's KV over each transport, against memcpy and raw Redis."""

from __future__ import annotations

import asyncio
import random
import sys
import time
import uuid

import redis.asyncio as aioredis
import torch

from pdserve.bench.roofline import best_time
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPoolIO, allocate_pool
from pdserve.kvcache.transports.base import KVTransport
from pdserve.kvcache.transports.local import LocalHub, LocalTransport
from pdserve.kvcache.transports.redis import RedisTransport
from pdserve.runtime.redis_server import RedisServer

MIB = 1 << 20
LAYOUTS = {  # (num_layers, num_kv_heads, head_dim) of the tiny and the ~125M bench model, block 16, fp32
    "tiny": KVLayout("tiny", "float32", 4, 4, 32, 16),
    "llama-125m": KVLayout("llama-125m", "float32", 12, 4, 64, 16),
}


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _pool(layout: KVLayout, num_blocks: int) -> KVPoolIO:
    shape = (num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    pool = allocate_pool(shape, getattr(torch, layout.dtype), "cpu")  # as the engine allocates it
    return KVPoolIO(pool.copy_(torch.randn(shape, dtype=pool.dtype)))


def memcpy_gb_s(nbytes: int, repeats: int = 5) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return nbytes / best_time(lambda: dst.copy_(src), repeats) / 1e9


async def redis_raw_gb_s(url: str, nbytes: int, repeats: int) -> float:
    client = aioredis.from_url(url)
    value = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy().tobytes()
    best = float("inf")
    for _ in range(repeats):
        key = f"bench-raw-{uuid.uuid4().hex}"
        start = time.perf_counter()
        await client.set(key, value)
        got = await client.get(key)
        best = min(best, time.perf_counter() - start)
        assert len(got) == nbytes
        await client.delete(key)
    await client.aclose()
    return nbytes / best / 1e9


async def _move(src: KVTransport, dst: KVTransport, num_blocks: int) -> float:
    """One handoff end to end: export on the prefill pool, pull into the decode pool."""
    src_ids = list(range(num_blocks))
    dst_ids = list(range(num_blocks))
    hashes = [random.getrandbits(64) for _ in src_ids]  # fresh content addresses: nothing deduplicated
    lease = uuid.uuid4().hex
    start = time.perf_counter()
    params = await src.export(lease, src_ids, hashes, num_blocks * src.layout.block_size)
    await dst.pull(params, dst_ids)
    elapsed = time.perf_counter() - start
    if not torch.equal(src.pool.block_tensor(0), dst.pool.block_tensor(dst_ids[0])):
        raise AssertionError("transferred block differs")
    return elapsed


async def _transport_pair(name: str, layout: KVLayout, num_blocks: int, redis_url: str):
    async def release(_lease: str) -> None:  # the bench's pools are not engine-owned: nothing to free
        return None

    src_pool, dst_pool = _pool(layout, num_blocks), _pool(layout, num_blocks)
    if name == "local":
        hub = LocalHub()
        return LocalTransport(src_pool, layout, release, hub=hub), LocalTransport(dst_pool, layout, hub=hub)
    if name == "redis":
        src = RedisTransport(src_pool, layout, release, url=redis_url, ttl_s=60, batch_blocks=256)
        dst = RedisTransport(dst_pool, layout, url=redis_url, batch_blocks=256)
        return src, dst
    raise ValueError(name)


async def _ucx_cross_process(layout_name: str, num_blocks: int, repeats: int, error_handling: bool) -> float:
    """Best pull time from an exporter in another process (the case UCX's shared-memory paths serve)."""
    import json
    import os

    from pdserve.bench.ucx_peer import seeded_pool
    from pdserve.kvcache.params import HandoffParams
    from pdserve.kvcache.transports.ucx import UCXConfig, UCXTransport

    layout = LAYOUTS[layout_name]
    mode = "eh" if error_handling else "no-eh"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.bench.ucx_peer", layout_name, str(num_blocks), str(repeats + 1), mode,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
        limit=1 << 28,
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        all_params = [HandoffParams.from_dict(p) for p in json.loads(line)]
        dst_pool = _pool(layout, num_blocks)
        dst = UCXTransport(dst_pool, layout, config=UCXConfig.for_pool(dst_pool, endpoint_error_handling=error_handling))
        await dst.start()
        expected = seeded_pool(layout, num_blocks)
        dst_ids = list(range(num_blocks))  # a fresh reservation is consecutive: one message per run
        times = []
        try:
            for params in all_params:
                start = time.perf_counter()
                await dst.pull(params, dst_ids)
                times.append(time.perf_counter() - start)
        finally:
            await dst.close()
        if not torch.equal(expected.block_tensor(0), dst.pool.block_tensor(dst_ids[0])):
            raise AssertionError("transferred block differs")
        _log("ucx pull times ms: " + " ".join(f"{t * 1e3:.1f}" for t in times))
        return min(times[1:])  # the first pull pays connection setup
    finally:
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 30)


def _add_row(rows: list, name: str, layout_name: str, layout: KVLayout, num_blocks: int, best: float, ref: float) -> None:
    nbytes = num_blocks * layout.block_nbytes
    gb_s = nbytes / best / 1e9
    row = {
        "transport": name.split("-")[0], "layout": layout_name, "bytes": nbytes, "num_blocks": num_blocks,
        "gb_s": round(gb_s, 3), "ref": "redis_raw_gb_s" if name == "redis" else "memcpy_gb_s",
        "ratio": round(gb_s / ref, 3),
    }
    if name.startswith("ucx"):  # "ucx" is the default config; "ucx-no-eh" turns endpoint error handling off
        row["endpoint_error_handling"] = name == "ucx"
    rows.append(row)
    _log(f"{name:8s} {layout_name:10s} {nbytes / MIB:6.1f} MiB: {gb_s:.2f} GB/s ({gb_s / ref:.2f} of ref)")


async def _run(sizes_mib: list[int], transports: list[str], repeats: int) -> dict:
    rows = []
    with RedisServer() as server:
        server_raw = {}
        for size in sizes_mib:
            server_raw[size] = await redis_raw_gb_s(server.url, size * MIB, repeats)
            _log(f"redis raw {size} MiB: {server_raw[size]:.2f} GB/s")
        memcpy = {size: memcpy_gb_s(max(size, 16) * MIB) for size in sizes_mib}
        for layout_name, layout in LAYOUTS.items():
            for size in sizes_mib:
                num_blocks = max(1, size * MIB // layout.block_nbytes)
                for name in transports:
                    if name in ("ucx", "ucx-no-eh"):
                        best = await _ucx_cross_process(layout_name, num_blocks, repeats, name == "ucx")
                        _add_row(rows, name, layout_name, layout, num_blocks, best, memcpy[size])
                        continue
                    src, dst = await _transport_pair(name, layout, num_blocks, server.url)
                    await src.start()
                    await dst.start()
                    try:
                        await _move(src, dst, num_blocks)  # warm-up: connections, registration
                        best = min([await _move(src, dst, num_blocks) for _ in range(repeats)])
                    finally:
                        await dst.close()
                        await src.close()
                    _add_row(rows, name, layout_name, layout, num_blocks, best,
                             server_raw[size] if name == "redis" else memcpy[size])
    return {
        "bench": "transfer",
        "memcpy_gb_s": {str(k): round(v, 2) for k, v in memcpy.items()},
        "redis_raw_gb_s": {str(k): round(v, 3) for k, v in server_raw.items()},
        "rows": rows,
    }


def run(sizes_mib: list[int] | None = None, transports: list[str] | None = None, repeats: int = 3) -> dict:
    return asyncio.run(_run(sizes_mib or [1, 16, 64, 256], transports or ["local", "redis", "ucx", "ucx-no-eh"], repeats))
