"""`pdserve bench transfer`: move one request's KV over each transport, against memcpy and raw Redis."""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable

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
# Copies of each KV byte between the prefill pool and the decode pool, kernel copies included.
COPIES_PER_HANDOFF = {
    "local": 1,  # pool to pool, in one process
    "shm": 1,  # the default between processes of one node: process_vm_readv, the exporter's pool to the importer's
    "shm-staged": 2,  # where the kernel forbids that: prefill pool -> shared staging slot -> decode pool
    "ucx": 2,  # with endpoint error handling (the default across nodes): TCP, into and out of the kernel
    "ucx-no-eh": 1,  # CMA: the kernel copies pool to pool (process_vm_readv)
    "redis": 6,  # encode, socket into Redis, Redis's copy, socket out, client buffer, into the pool (at least)
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
    pulls, _, _, _ = await _cross_process(layout_name, num_blocks, repeats + 1, "eh" if error_handling else "no-eh")
    _log("ucx pull times ms: " + " ".join(f"{t * 1e3:.1f}" for t in pulls))
    return min(pulls[1:])  # the first pull pays connection setup


async def _cross_process(
    layout_name: str, num_blocks: int, num_pulls: int, mode: str, between: Callable[[], float] | None = None,
    direct_read: bool = True,
) -> tuple[list[float], list[float], list[float], int]:
    """Pull times of `num_pulls` leases exported by a peer process (`pdserve.bench.ucx_peer` in `mode`),
    its export times, what `between()` returned before each pull (a reference timed in turn with them), and
    (same-host) the copies each handoff took: 1 read directly out of the exporter's pool, 2 staged."""
    import json
    import os

    from pdserve.bench.ucx_peer import seeded_pool
    from pdserve.kvcache.params import HandoffParams
    from pdserve.kvcache.transports.same_host import SameHostFirst
    from pdserve.kvcache.transports.shm import ShmConfig, ShmTransport
    from pdserve.kvcache.transports.ucx import UCXConfig, UCXTransport

    layout = LAYOUTS[layout_name]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.bench.ucx_peer", layout_name, str(num_blocks), str(num_pulls), mode,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
        limit=1 << 28,
    )
    try:
        all_params = [HandoffParams.from_dict(p) for p in json.loads(await asyncio.wait_for(proc.stdout.readline(), 120))]
        export_s = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        dst_pool = _pool(layout, num_blocks)
        config = UCXConfig.for_pool(dst_pool, endpoint_error_handling=mode != "no-eh")
        dst: KVTransport = UCXTransport(dst_pool, layout, config=config)
        if mode == "same-host":
            local = ShmTransport(dst_pool, layout, config=ShmConfig(direct_read=direct_read))
            dst = SameHostFirst(dst_pool, layout, remote=dst, local=local)
        await dst.start()
        expected = seeded_pool(layout, num_blocks)
        dst_ids = list(range(num_blocks))  # a fresh reservation is consecutive: one message per run
        pulls, refs = [], []
        try:
            for params in all_params:
                refs.append(between() if between is not None else 0.0)
                start = time.perf_counter()
                await dst.pull(params, dst_ids)
                pulls.append(time.perf_counter() - start)
        finally:
            await dst.close()
        copies = 0
        if mode == "same-host":
            if dst.pulls_by_path["shm"] != len(all_params):
                raise AssertionError(f"same-host pulls took other paths: {dict(dst.pulls_by_path)}")
            client = dst.local.client
            copies = 1 if client.num_direct_pulls == len(all_params) else 2 if client.num_staged_pulls == len(all_params) else -1
        if not torch.equal(expected.block_tensor(num_blocks - 1), dst.pool.block_tensor(dst_ids[-1])):
            raise AssertionError("transferred block differs")
        return pulls, export_s, refs, copies
    finally:
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 30)


async def same_host_ratio(sizes_mib: list[int], repeats: int, layout_name: str = "llama-125m",
                          direct_read: bool = True) -> dict:
    """The workers' default transport between two processes of one node against a memcpy of the same bytes,
    timed in turn (memcpy, pull, memcpy, pull, ...) so that both see the same machine; the first pull,
    which opens the connection, is left out. `direct_read=False`: the staged lane (where the kernel does
    not let the importer read the exporter's memory)."""
    layout = LAYOUTS[layout_name]
    by_size = {}
    for size in sizes_mib:
        num_blocks = max(1, size * MIB // layout.block_nbytes)
        nbytes = num_blocks * layout.block_nbytes
        src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        dst.copy_(src)

        def memcpy(src: torch.Tensor = src, dst: torch.Tensor = dst) -> float:
            start = time.perf_counter()
            dst.copy_(src)
            return time.perf_counter() - start

        pulls, exports, refs, copies = await _cross_process(layout_name, num_blocks, repeats + 1, "same-host", memcpy,
                                                            direct_read)
        ratios = sorted(ref / pull for ref, pull in zip(refs[1:], pulls[1:]))
        # export included: what the handoff adds to TTFT, against the same memcpy
        whole = sorted(ref / (pull + export) for ref, pull, export in zip(refs[1:], pulls[1:], exports[1:]))
        by_size[str(size)] = {
            "bytes": nbytes, "runs": len(ratios), "median": round(statistics.median(ratios), 3),
            "min": round(ratios[0], 3), "max": round(ratios[-1], 3),
            "with_export_median": round(statistics.median(whole), 3),
            "pull_ms_median": round(statistics.median(pulls[1:]) * 1e3, 2),
            "memcpy_ms_median": round(statistics.median(refs[1:]) * 1e3, 2),
            "export_ms_median": round(statistics.median(exports[1:]) * 1e3, 2),  # UCX header checksums included
        }
        _log(f"same-host {size:4d} MiB: pull/memcpy {by_size[str(size)]}")
    return {"layout": layout_name, "path": "shm", "by_size_mib": by_size, "copies_per_handoff": copies,
            "worst_median": min(v["median"] for v in by_size.values())}


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
        for size in sizes_mib if "redis" in transports else []:
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
        "copies_per_handoff": COPIES_PER_HANDOFF,
    }


def run(sizes_mib: list[int] | None = None, transports: list[str] | None = None, repeats: int = 3,
        same_host_sizes_mib: list[int] | None = None, same_host_repeats: int = 7, overlap_requests: int = 8,
        cross_ns_repeats: int = 5) -> dict:
    """`transports`: rows against memcpy or raw Redis (default all); "shm" among them (or by default) adds
    `same_host_ratio` over `same_host_sizes_mib` (default 16, 64, 256 MiB), "shm-staged" the same for the
    staged lane (`same_host_staged_ratio`), "overlap" `exposed_transfer_fraction` and the TTFT with the KV
    in parts and whole, from `pdserve serve` on the default model (pdserve.bench.overlap, default path),
    "cross-ns" `cross_ns_ratio`: UCX against a raw TCP stream across a veth pair between two network
    namespaces, at the largest same-host size (pdserve.bench.netns; null, with the reason, where this
    machine cannot make namespaces)."""
    names = ["local", "redis", "ucx", "ucx-no-eh", "shm", "shm-staged", "overlap", "cross-ns"] if transports is None \
        else list(transports)
    rows = [n for n in names if not n.startswith("shm") and n not in ("overlap", "cross-ns")]
    result = asyncio.run(_run(sizes_mib or [1, 16, 64, 256], rows, repeats))
    if "overlap" in names:
        from pdserve.bench import overlap

        runs = overlap.run(["shm"], num_requests=overlap_requests)
        off, on = runs["runs"]
        result["exposed_transfer_fraction"] = runs["exposed_transfer_fraction"]
        result["ttft_ms_p50_parts_off_on"] = [off["ttft_ms_p50"], on["ttft_ms_p50"]]
        result["first_gap_ms_p50_parts_off_on"] = [off["first_gap_ms_p50"], on["first_gap_ms_p50"]]
        result["overlap"] = runs
    sizes = same_host_sizes_mib or [16, 64, 256]
    if "shm" in names and same_host_repeats > 0:
        result["same_host_ratio"] = asyncio.run(same_host_ratio(sizes, same_host_repeats))
    if "shm-staged" in names and same_host_repeats > 0:
        result["same_host_staged_ratio"] = asyncio.run(same_host_ratio(sizes, same_host_repeats, direct_read=False))
    if "cross-ns" in names and cross_ns_repeats > 0:
        from pdserve.bench import netns

        try:
            runs = netns.run([max(sizes)], cross_ns_repeats)
        except netns.NetnsUnavailable as exc:
            result["cross_ns_ratio"], result["cross_ns"] = None, {"skipped": str(exc)}
        else:
            result["cross_ns_ratio"], result["cross_ns"] = runs["cross_ns_ratio"], runs
    return result
