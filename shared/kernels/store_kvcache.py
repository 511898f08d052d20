"""Scatter this step's K/V rows into the paged caches through the slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import cache_operands
from pdserve.kernels.kv_quant import MIN_SCALE, QMAX, SCALE_MARGIN, QuantizedCache, store_kvcache_quant_ref


def store_kvcache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | QuantizedCache, v_cache: torch.Tensor | QuantizedCache,
    slot_mapping: torch.Tensor,
) -> None:
    # k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; slot -1 = skip
    if isinstance(k_cache, QuantizedCache):
        store_kvcache_quant_ref(k, v, k_cache, v_cache, slot_mapping)
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


@triton.jit
def _quantize_rows(x, QUANT: tl.constexpr, QMAX_: tl.constexpr, MARGIN: tl.constexpr, MIN_S: tl.constexpr):
    # x: [H, D] fp (masked entries 0) -> (values [H, D] int8 | fp8 bytes as int8, scales [H] fp16);
    # the same arithmetic as kv_quant.quantize, so the interpreter matches it bit for bit
    xf = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(xf), 1) * (MARGIN / QMAX_), MIN_S).to(tl.float16)
    y = xf / scale.to(tl.float32)[:, None]
    if QUANT == 1:
        q = tl.minimum(tl.maximum(tl.floor(y + 0.5), -127.0), 127.0).to(tl.int8)
    else:
        q = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv).to(tl.int8, bitcast=True)
    return q, scale


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kco, stride_kch, stride_kcd,
    stride_vcb, stride_vco, stride_vch, stride_vcd,
    stride_ksb, stride_kso, stride_ksh,
    stride_vsb, stride_vso, stride_vsh,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr, QMAX_: tl.constexpr, MARGIN: tl.constexpr, MIN_S: tl.constexpr,
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
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask, other=0.0)
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kco + heads * stride_kch + dims * stride_kcd
    vc = v_cache_ptr + block * stride_vcb + offset * stride_vco + heads * stride_vch + dims * stride_vcd
    if QUANT:
        k, k_scale = _quantize_rows(k, QUANT, QMAX_, MARGIN, MIN_S)
        v, v_scale = _quantize_rows(v, QUANT, QMAX_, MARGIN, MIN_S)
        h = tl.arange(0, BLOCK_H)
        h_mask = (h < num_kv_heads) & ((h * 0 + slot) >= 0)
        tl.store(k_scale_ptr + block * stride_ksb + offset * stride_kso + h * stride_ksh, k_scale, mask=h_mask)
        tl.store(v_scale_ptr + block * stride_vsb + offset * stride_vso + h * stride_vsh, v_scale, mask=h_mask)
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | QuantizedCache, v_cache: torch.Tensor | QuantizedCache,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `store_kvcache_ref`; any strides on k, v and the caches. Quantized caches get
    int8 (or fp8 e4m3) values and their per-(token, KV head) scales."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert v.shape == k.shape and k_cache.shape == v_cache.shape and k_cache.shape[2:] == k.shape[1:]
    assert slot_mapping.shape == (num_tokens,)
    k_data, k_scale, k_scale_strides, quant = cache_operands(k_cache)
    v_data, v_scale, v_scale_strides, _ = cache_operands(v_cache)
    if quant == 2 and triton.knobs.runtime.interpret:
        # seen here: the interpreter's fp32 -> fp8e4nv cast halves values whose rounding carries into the
        # exponent (127.9 -> 64), so fp8 stores are not checked on CPU; compiled (CUDA) casts are the hardware's
        raise NotImplementedError("fp8_e4m3 KV stores need a compiled Triton kernel (not the interpreter)")
    qmax = QMAX[k_cache.kv_cache_dtype] if quant else 1.0
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_data, v_data, slot_mapping, k_scale, v_scale,
        *k.stride(), *v.stride(), *k_data.stride(), *v_data.stride(), *k_scale_strides, *v_scale_strides,
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=quant, QMAX_=qmax, MARGIN=SCALE_MARGIN, MIN_S=MIN_SCALE,
    )
