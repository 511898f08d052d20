"""Exporting side of the UCX transfer benchmark, run as its own process so bytes cross processes.

    python -m pdserve.bench.ucx_peer LAYOUT NUM_BLOCKS NUM_LEASES

Prints one JSON line of HandoffParams dicts (one lease per timed pull), then serves until stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

import torch

from pdserve.kvcache.pool import KVPoolIO


def seeded_pool(layout, num_blocks: int) -> KVPoolIO:
    gen = torch.Generator().manual_seed(1234)
    shape = (num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return KVPoolIO(torch.randn(shape, generator=gen).to(getattr(torch, layout.dtype)))


async def _serve(layout_name: str, num_blocks: int, num_leases: int) -> None:
    from pdserve.bench.transfer import LAYOUTS
    from pdserve.kvcache.transports.ucx import UCXTransport

    layout = LAYOUTS[layout_name]
    pool = seeded_pool(layout, num_blocks)
    transport = UCXTransport(pool, layout)
    await transport.start()
    ids = list(range(num_blocks))
    params = [
        (await transport.export(uuid.uuid4().hex, ids, list(range(1, num_blocks + 1)), num_blocks * layout.block_size)).to_dict()
        for _ in range(num_leases)
    ]
    print(json.dumps(params), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await transport.close()


if __name__ == "__main__":
    name, blocks, leases = sys.argv[1:4]
    asyncio.run(_serve(name, int(blocks), int(leases)))
