"""Scatter this step's K/V rows into the paged caches through the slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def store_kvcache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot -1 = skip
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # one program per token: all heads of its K row and V row
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    # slot broadcast to a tensor: the interpreter rejects a scalar bool in a tensor mask
    mask = (heads < num_kv_heads) & (dims < head_dim) & ((heads * 0 + slot) >= 0)
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads * stride_kch + dims * stride_kcd
    vc = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads * stride_vch + dims * stride_vcd
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as `store_kvcache_ref`; any strides on k, v and the caches."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert v.shape == k.shape and k_cache.shape == v_cache.shape and k_cache.shape[2:] == k.shape[1:]
    assert slot_mapping.shape == (num_tokens,)
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
