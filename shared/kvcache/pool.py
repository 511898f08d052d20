"""Byte-level access to the engine's KV pool, one block at a time (a block is contiguous)."""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np
import torch

_HUGE_PAGE = 2 << 20


def allocate_pool(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed KV pool. On the host it is anonymous memory advised for transparent huge pages
    (where the kernel offers them): one page-table entry per 2 MiB instead of per 4 KiB, which
    roughly doubles UCX's cross-process copies here (CMA pins and walks every page it moves) and
    spares the attention gathers TLB misses. The pool lives as long as the engine."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(*shape, dtype=dtype, device=device)
    nbytes = max(1, int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size())
    # private: anonymous shared memory would be shmem, which has its own (usually off) huge page switch
    region = mmap.mmap(-1, -(-nbytes // _HUGE_PAGE) * _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    pool = torch.frombuffer(region, dtype=torch.uint8, count=nbytes).view(dtype).view(*shape)  # holds `region`
    pool.zero_()  # fault every page in now, not on the first transfer
    return pool


class KVPoolIO:
    def __init__(self, kv_pool: torch.Tensor) -> None:
        # kv_pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous
        if not kv_pool.is_contiguous():
            raise ValueError("KV pool must be contiguous")
        self.kv_pool = kv_pool
        self.num_blocks = kv_pool.shape[0]
        self.block_nbytes = kv_pool[0].numel() * kv_pool.element_size()
        self._bytes = kv_pool.view(self.num_blocks, -1).view(torch.uint8)  # [num_blocks, block_nbytes]

    @property
    def is_host(self) -> bool:
        return self.kv_pool.device.type == "cpu"

    def block_tensor(self, block_id: int) -> torch.Tensor:
        """The block's bytes as a uint8 tensor viewing the pool (host or device memory)."""
        self._check(block_id)
        return self._bytes[block_id]

    def block_buffer(self, block_id: int) -> memoryview:
        """Host memoryview aliasing the pool block (CPU pools only)."""
        if not self.is_host:
            raise ValueError("block_buffer needs a host pool; use block_tensor on devices")
        return memoryview(self.block_tensor(block_id).numpy())

    def read_blocks(self, block_ids: Sequence[int]) -> list[memoryview]:
        if self.is_host:
            return [self.block_buffer(b) for b in block_ids]
        return [memoryview(self.block_tensor(b).cpu().numpy()) for b in block_ids]

    def write_block(self, block_id: int, data: memoryview | bytes) -> None:
        source = np.frombuffer(data, dtype=np.uint8)  # read-only views are fine: we only read them
        if source.size != self.block_nbytes:
            raise ValueError(f"block payload is {source.size} bytes, expected {self.block_nbytes}")
        if self.is_host:
            self.block_tensor(block_id).numpy()[:] = source
        else:
            self.block_tensor(block_id).copy_(torch.from_numpy(source.copy()))

    def _check(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} outside the pool of {self.num_blocks}")
