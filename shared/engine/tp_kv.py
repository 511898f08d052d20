"""KV handoff for a tensor-parallel replica: the wire carries whole-model blocks, the ranks hold head ranges.

Each rank's pool holds only its KV heads (pdserve.models.tensor_parallel.shard_plan). A handoff's blocks
travel in the canonical layout, the one a TP=1 engine pools, so a replica of any TP degree exchanges KV
with one of any other (same layout hash) and no transport knows about ranks:

- export: after the step that finished them, a handoff's (or a part's) blocks are gathered from every
  rank into the driver's canonical pool, from which the transport reads them;
- import: the transport writes pulled blocks into the canonical pool, and adopting the lease (or caching
  it) first scatters each rank its head range.

Both run as one command on the ranks' control group between steps (the caller holds the engine's lock),
with point-to-point gloo messages of [n, num_layers, 2, block_size, rank's KV heads, head_dim].
The canonical pool costs the driver one whole-model KV pool; it is allocated on first use, so a replica
that never hands KV off never pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.kvcache.pool import allocate_pool
from pdserve.models.config import ModelConfig
from pdserve.models.tensor_parallel import shard_plan

GATHER, SCATTER = 2, 3  # control-group commands beside tp_group's STEP and STOP


class ShardedKV:
    """The driver's side: `canonical` (allocated on first use) and the moves between it and the ranks."""

    def __init__(self, tensor_parallel, local_pool: torch.Tensor, config: ModelConfig) -> None:
        # local_pool: [num_blocks, L, 2, block_size, rank 0's KV heads, head_dim]
        if local_pool.dim() != 6:
            raise ValueError("KV handoff with tensor_parallel_size > 1 needs kv_cache_dtype auto "
                             "(a quantized pool packs scales beside the heads)")
        self.tp = tensor_parallel
        self.local_pool = local_pool
        self.kv_heads = [shard_plan(config, r, tensor_parallel.world_size).kv_heads
                         for r in range(tensor_parallel.world_size)]
        self.shape = (*local_pool.shape[:4], config.num_kv_heads, local_pool.shape[5])
        self._canonical: torch.Tensor | None = None
        self.num_gathered = self.num_scattered = 0  # blocks moved, for tests and stats

    @property
    def canonical(self) -> torch.Tensor:
        """[num_blocks, L, 2, block_size, num_kv_heads, head_dim]: the blocks a transport reads and writes."""
        if self._canonical is None:
            self._canonical = allocate_pool(self.shape, self.local_pool.dtype, self.local_pool.device)
        return self._canonical

    def gather(self, block_ids: Sequence[int]) -> None:
        """Every rank's heads of `block_ids` into the canonical pool."""
        if not block_ids:
            return
        ids = self._command(GATHER, block_ids)
        out = self.canonical
        rows = self.local_pool.index_select(0, ids)
        out[ids, ..., _slice(self.kv_heads[0]), :] = rows
        for rank in range(1, len(self.kv_heads)):
            heads = self.kv_heads[rank]
            buf = torch.empty((len(block_ids), *self.shape[1:4], len(heads), self.shape[5]), dtype=out.dtype)
            self.tp.recv(buf, rank)
            out[ids, ..., _slice(heads), :] = buf
        self.num_gathered += len(block_ids)

    def scatter(self, block_ids: Sequence[int]) -> None:
        """The canonical pool's `block_ids` out to every rank's pool, each its own heads."""
        if not block_ids:
            return
        ids = self._command(SCATTER, block_ids)
        rows = self.canonical.index_select(0, ids)  # [n, L, 2, bs, H, D]
        for rank in range(1, len(self.kv_heads)):
            self.tp.send(rows[..., _slice(self.kv_heads[rank]), :].contiguous(), rank)
        self.local_pool[ids] = rows[..., _slice(self.kv_heads[0]), :]
        self.num_scattered += len(block_ids)

    def _command(self, command: int, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
        self.tp.command(command, ids)
        return ids


def serve_command(command: int, ids: torch.Tensor, pool: torch.Tensor, send, recv) -> None:
    """A worker rank's side of GATHER (send its heads of `ids` to the driver) or SCATTER (receive them)."""
    if command == GATHER:
        send(pool.index_select(0, ids))
    elif command == SCATTER:
        buf = torch.empty((ids.numel(), *pool.shape[1:]), dtype=pool.dtype)
        recv(buf)
        pool[ids] = buf
    else:
        raise ValueError(f"unknown tensor-parallel command {command}")


def _slice(heads: range) -> slice:
    return slice(heads.start, heads.stop)
