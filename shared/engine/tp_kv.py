"""KV handoff for a tensor-parallel replica: the wire carries whole-model blocks, the ranks hold head ranges.

Each rank's pool holds only its KV heads (pdserve.models.tensor_parallel.shard_plan). A handoff's blocks
travel in the canonical layout, the one a TP=1 engine pools, so a replica of any TP degree exchanges KV
with one of any other (same layout hash) and no transport knows about ranks:

- export: after the step that finished them, a handoff's (or a part's) blocks are gathered from every
  rank into the driver's canonical pool, from which the transport reads them;
- import: the transport writes pulled blocks into the canonical pool, and adopting the lease (or caching
  it) first scatters each rank its head range.

Both run as one command on the ranks' control group between steps (the caller holds the engine's lock).
Between ranks a block moves as the rank's own pool row; the driver splits rows by head through views
that put the KV-head dimension at index 4: the pool itself when unquantized, else its values and its
scales (pdserve.kvcache.quant). The canonical pool costs the driver one whole-model KV pool; it is
allocated on first use, so a replica that never hands KV off never pays for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from pdserve.kvcache.quant import allocate_kv_cache, is_quantized_dtype, kv_block_nbytes, value_scale_views
from pdserve.models.config import ModelConfig
from pdserve.models.tensor_parallel import shard_plan

GATHER, SCATTER = 2, 3  # control-group commands beside tp_group's STEP and STOP


class ShardedKV:
    """The driver's side: `canonical` (allocated on first use) and the moves between it and the ranks."""

    def __init__(self, tensor_parallel, local_pool: torch.Tensor, config: ModelConfig, block_size: int,
                 model_dtype: torch.dtype, kv_cache_dtype: str = "auto") -> None:
        self.tp = tensor_parallel
        self.local_pool = local_pool  # rank 0's: [num_blocks, ...its row...]
        self.config, self.block_size, self.model_dtype = config, block_size, model_dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_heads = [shard_plan(config, r, tensor_parallel.world_size).kv_heads
                         for r in range(tensor_parallel.world_size)]
        self._canonical: torch.Tensor | None = None
        self.num_gathered = self.num_scattered = 0  # blocks moved, for tests and stats

    @property
    def canonical(self) -> torch.Tensor:
        """The whole model's pool, laid out as a TP=1 engine's: the blocks a transport reads and writes."""
        if self._canonical is None:
            self._canonical, _ = allocate_kv_cache(self.config, self.block_size, self.local_pool.shape[0],
                                                   self.model_dtype, self.kv_cache_dtype, self.local_pool.device)
        return self._canonical

    def gather(self, block_ids: Sequence[int]) -> None:
        """Every rank's heads of `block_ids` into the canonical pool."""
        if not block_ids:
            return
        ids = self._command(GATHER, block_ids)
        whole = self._views(self.canonical, self.config.num_kv_heads)
        for rank, heads in enumerate(self.kv_heads):
            if rank == 0:
                rows = self.local_pool.index_select(0, ids)
            else:
                rows = self._rows(len(block_ids), heads)
                self.tp.recv(rows, rank)
            for out, part in zip(whole, self._views(rows, len(heads))):
                out[ids, :, :, :, heads.start:heads.stop] = part
        self.num_gathered += len(block_ids)

    def scatter(self, block_ids: Sequence[int]) -> None:
        """The canonical pool's `block_ids` out to every rank's pool, each its own heads."""
        if not block_ids:
            return
        ids = self._command(SCATTER, block_ids)
        taken = [v.index_select(0, ids) for v in self._views(self.canonical, self.config.num_kv_heads)]
        for rank, heads in enumerate(self.kv_heads):
            rows = self._rows(len(block_ids), heads)
            for part, whole in zip(self._views(rows, len(heads)), taken):
                part.copy_(whole[:, :, :, :, heads.start:heads.stop])
            if rank == 0:
                self.local_pool[ids] = rows
            else:
                self.tp.send(rows, rank)
        self.num_scattered += len(block_ids)

    def _rows(self, n: int, heads: range) -> torch.Tensor:
        """n pool rows of a rank holding `heads`, shaped as its pool's."""
        if not is_quantized_dtype(self.kv_cache_dtype):
            shape = (*self.local_pool.shape[1:4], len(heads), self.config.head_dim)
            return torch.empty((n, *shape), dtype=self.local_pool.dtype)
        nbytes = kv_block_nbytes(replace(self.config, num_kv_heads=len(heads)), self.block_size, self.model_dtype,
                                 self.kv_cache_dtype)
        return torch.empty((n, nbytes), dtype=torch.uint8)

    def _views(self, rows: torch.Tensor, num_heads: int) -> list[torch.Tensor]:
        """Views of pool rows with the KV-head dimension at index 4: [rows] or [values, scales]."""
        if not is_quantized_dtype(self.kv_cache_dtype):
            return [rows]
        c = self.config
        return list(value_scale_views(rows, c.num_layers, self.block_size, num_heads, c.head_dim, self.kv_cache_dtype))

    def _command(self, command: int, block_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(list(block_ids), dtype=torch.int64)
        self.tp.command(command, ids)
        return ids


def serve_command(command: int, ids: torch.Tensor, pool: torch.Tensor, send, recv) -> None:
    """A worker rank's side of GATHER (send its rows of `ids` to the driver) or SCATTER (receive them)."""
    if command == GATHER:
        send(pool.index_select(0, ids))
    elif command == SCATTER:
        buf = torch.empty((ids.numel(), *pool.shape[1:]), dtype=pool.dtype)
        recv(buf)
        pool[ids] = buf
    else:
        raise ValueError(f"unknown tensor-parallel command {command}")
