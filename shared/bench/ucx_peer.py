"""Exporting side of the UCX transfer benchmark, run as its own process so bytes cross processes.

    python -m pdserve.bench.ucx_peer LAYOUT NUM_BLOCKS NUM_LEASES [eh|no-eh|same-host]

Prints one JSON line of HandoffParams dicts (one lease per timed pull) and one of the export times in
seconds, then serves until stdin closes. same-host: the workers' default transport (UCX with endpoint
error handling, shared with the shared-memory path), as `build_transport` makes it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid

import torch

from pdserve.kvcache.pool import KVPoolIO, allocate_pool


def seeded_pool(layout, num_blocks: int) -> KVPoolIO:
    gen = torch.Generator().manual_seed(1234)
    shape = (num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    pool = allocate_pool(shape, getattr(torch, layout.dtype), "cpu")  # as the engine allocates it
    return KVPoolIO(pool.copy_(torch.randn(shape, generator=gen)))


async def _serve(layout_name: str, num_blocks: int, num_leases: int, error_handling: bool, same_host: bool) -> None:
    from pdserve.bench.transfer import LAYOUTS
    from pdserve.kvcache.transports.same_host import SameHostFirst
    from pdserve.kvcache.transports.shm import ShmTransport
    from pdserve.kvcache.transports.ucx import UCXConfig, UCXTransport

    layout = LAYOUTS[layout_name]
    pool = seeded_pool(layout, num_blocks)
    transport = UCXTransport(pool, layout, config=UCXConfig.for_pool(pool, endpoint_error_handling=error_handling))
    if same_host:
        transport = SameHostFirst(pool, layout, remote=transport, local=ShmTransport(pool, layout))
    await transport.start()
    ids = list(range(num_blocks))
    params, export_s = [], []
    for _ in range(num_leases):
        start = time.perf_counter()
        params.append((await transport.export(uuid.uuid4().hex, ids, list(range(1, num_blocks + 1)),
                                              num_blocks * layout.block_size)).to_dict())
        export_s.append(time.perf_counter() - start)
    print(json.dumps(params), flush=True)
    print(json.dumps(export_s), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await transport.close()


if __name__ == "__main__":
    name, blocks, leases = sys.argv[1:4]
    mode = sys.argv[4] if len(sys.argv) > 4 else "eh"
    if mode not in ("eh", "no-eh", "same-host"):
        raise SystemExit(f"mode must be eh, no-eh or same-host, not {mode!r}")
    asyncio.run(_serve(name, int(blocks), int(leases), mode != "no-eh", mode == "same-host"))
