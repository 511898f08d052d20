"""Decode attention and the KV store over the paged float32 (or float16) cache on CPU, through the native library
(`cpu/paged_decode.c`, built by pdserve.kernels.cpu_native): one call per decode group where torch's path
gathers the blocks, pads and runs scaled_dot_product_attention (about 100 us a layer at one sequence)."""

from __future__ import annotations

import torch

from pdserve.kernels.cpu_native import library


def native_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The native path takes these: plain float32 or float16 CPU caches [num_blocks, block_size, Hkv, D],
    each block contiguous and both with the same dtype and block stride (a layer's view of the engine's
    pool), and the library is built (for float16, with F16C)."""
    lib = library()
    return all(
        type(t) is torch.Tensor and t.dtype in (torch.float32, torch.float16) and t.device.type == "cpu"
        and t.dim() == 4 and t.stride()[1:] == (t.shape[2] * t.shape[3], t.shape[3], 1)
        and t.stride(0) >= t[0].numel()
        for t in (k_cache, v_cache)
    ) and k_cache.stride() == v_cache.stride() and k_cache.dtype is v_cache.dtype and lib is not None and (
        k_cache.dtype is torch.float32 or bool(lib.pd_kv_half_supported()))


def is_half(cache: torch.Tensor) -> int:
    """The kernels' `half` flag: 1 for a float16 cache."""
    return int(cache.dtype is torch.float16)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] float32 -> [n, H, D]; caches [num_blocks, block_size, Hkv, D] (blocks may be strided:
    `native_cache`); block_tables [n, width] int64; context_lens [n] int64 (the current token included)."""
    q = q.contiguous()
    n, heads, head_dim = q.shape
    tables = block_tables.to(torch.int64).contiguous()  # the kernel reads int64 (no copy when it is)
    lens = context_lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    if library().pd_paged_decode(
        q.data_ptr(), n, heads, k_cache.shape[2], head_dim, k_cache.data_ptr(), v_cache.data_ptr(), is_half(k_cache),
        k_cache.shape[0], k_cache.shape[1], k_cache.stride(0), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        scale,
        out.data_ptr(),
    ):
        raise IndexError(f"decode attention: a context outruns its block table or a block id is outside the "
                         f"cache's {k_cache.shape[0]} blocks")
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """Write k, v [T, Hkv, D] at their slots; False (nothing written) when the rows are not in the layout
    the kernel reads (each token's heads contiguous, k and v with the same token stride)."""
    tokens, kv_heads, head_dim = k.shape
    row = kv_heads * head_dim
    if (k.stride(2), k.stride(1)) != (1, head_dim) or k.stride() != v.stride() or k.dtype is not torch.float32:
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    if library().pd_store_kv(k.data_ptr(), v.data_ptr(), tokens, k.stride(0), row, slots.data_ptr(), num_blocks,
                             block_size, k_cache.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                             is_half(k_cache)):
        raise IndexError(f"KV store: a slot is outside the cache's {num_blocks * block_size} slots")
    return True
