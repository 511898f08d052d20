"""Decode attention over the paged KV cache: split-K (flash-decoding) with GQA groups per program.

Stage 1, grid (B, Hkv, S): program (b, h, s) attends the `group` query heads of KV head h of
sequence b over the s-th slice of its context, reading each K/V row once for the whole group, and
writes a partial output normalized by its own sum plus the log-sum-exp of its scores.
Stage 2, grid (B, H): combines the S partials of each query head by their log-sum-exp.
With S == 1 stage 1 writes the final output and stage 2 is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import cache_operands, needs_upcast
from pdserve.kernels.kv_quant import QuantizedCache, dequantized_cache

LOG2E = 1.4426950408889634


def paged_decode_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor | QuantizedCache, v_cache: torch.Tensor | QuantizedCache,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    # q: [B, H, D]; caches: [num_blocks, block_size, Hkv, D] (quantized: dequantized to fp32 first);
    # block_tables: [B, W]; context_lens: [B]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    k_cache, v_cache = dequantized_cache(k_cache), dequantized_cache(v_cache)
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k = k_cache[block_tables[b]].flatten(0, 1)[:n].float()  # [n, Hkv, D]
        v = v_cache[block_tables[b]].flatten(0, 1)[:n].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def choose_num_splits(
    batch: int, max_context_len: int, num_kv_heads: int, num_sms: int = 132,
    min_tokens_per_split: int = 256, max_splits: int = 32,
) -> int:
    """Splits of each context so that stage 1 fills the GPU without splitting work too thin.

    Stage 1 launches batch * num_kv_heads * splits programs; aim for two per SM (one wave with
    room for latency hiding), but give every split at least `min_tokens_per_split` keys so the
    partial write and the reduce stay small next to the K/V reads, and cap at `max_splits`.
    Large batches (batch * num_kv_heads >= 2 * num_sms) or short contexts get 1 split: no reduce.
    """
    programs = max(1, batch * num_kv_heads)
    wanted = -(-2 * num_sms // programs)
    by_length = max(1, max_context_len // min_tokens_per_split)
    return max(1, min(wanted, by_length, max_splits))


@triton.jit
def dequantize_values(x, QUANT: tl.constexpr):
    # int8 values, or fp8 e4m3 bytes held as int8 (QUANT 2) -> fp32
    if QUANT == 2:
        return x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_tb, stride_tw,
    stride_ob, stride_oh, stride_od,
    stride_ksb, stride_kso, stride_ksh,
    stride_vsb, stride_vso, stride_vsh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    context_len = tl.load(context_lens_ptr + b).to(tl.int32)
    # this split's key range, aligned to BLOCK_N tiles
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g  # [G] query heads of this KV head
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + head[:, None] * stride_qh + d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [G, D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + b * stride_tb
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(table + (pos // BLOCK_SIZE) * stride_tw, mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        k_rows = block * stride_kb + offset * stride_ko + kv_head * stride_kh  # [N]
        v_rows = block * stride_vb + offset * stride_vo + kv_head * stride_vh
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :] * stride_kd, mask=kv_mask, other=0)  # [N, D]
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :] * stride_vd, mask=kv_mask, other=0)
        if QUANT:
            # dequantize on the fly: values [N, D] times their per-(token, KV head) scale [N]
            k_s = tl.load(k_scale_ptr + block * stride_ksb + offset * stride_kso + kv_head * stride_ksh,
                          mask=valid, other=0.0)
            v_s = tl.load(v_scale_ptr + block * stride_vsb + offset * stride_vso + kv_head * stride_vsh,
                          mask=valid, other=0.0)
            k = (dequantize_values(k, QUANT) * k_s.to(tl.float32)[:, None]).to(q.dtype)
            v = (dequantize_values(v, QUANT) * v_s.to(tl.float32)[:, None]).to(q.dtype)
        elif UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [G, N], log2 domain
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + b * stride_ob + head[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # partials: part_out [B, H, S, D] fp32, part_lse [B, H, S] fp32 (log2 domain; -inf when empty)
        row = (b * num_heads + head) * NUM_SPLITS + split  # [G]
        part_ptrs = part_out_ptr + row[:, None] * HEAD_DIM + d[None, :]
        tl.store(part_ptrs, out, mask=g_mask[:, None] & d_mask[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _paged_decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = b * tl.num_programs(1) + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < NUM_SPLITS
    d_mask = d < HEAD_DIM
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + s, mask=s_mask, other=float("-inf"))  # [S]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits weigh 0
    parts = tl.load(
        part_out_ptr + (row * NUM_SPLITS + s[:, None]) * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [S, D]
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + b * stride_ob + head * stride_oh + d * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def paged_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, max_context_len: int | None = None,
    num_splits: int | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_blocks, block_size, Hkv, D] (any strides; or QuantizedCache, dequantized
    on the fly); block_tables: [B, W]
    (int32/int64, entries past a sequence's blocks are never read); context_lens: [B] (the current
    token included). `max_context_len` only steers the split choice (default: W * block_size, no
    host sync). Returns out [B, H, D] (written into `out` when given)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    k_data, k_scale, k_scale_strides, quant = cache_operands(k_cache)
    v_data, v_scale, v_scale_strides, _ = cache_operands(v_cache)
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, max_context_len, num_kv_heads, _num_sms(q.device))
    block_n = max(block_size, 64)
    block_d = triton.next_power_of_2(head_dim)
    if num_splits > 1:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_data, v_data, block_tables, context_lens, out, part_out, part_lse, k_scale, v_scale,
        scale * LOG2E,
        *q.stride(), *k_data.stride(), *v_data.stride(), *block_tables.stride(), *out.stride(),
        *k_scale_strides, *v_scale_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        UPCAST=needs_upcast(q, k_cache), QUANT=quant, num_warps=4,
    )
    if num_splits > 1:
        _paged_decode_reduce_kernel[(batch, num_heads)](
            part_out, part_lse, out, *out.stride(),
            HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d, num_warps=1 if head_dim <= 64 else 2,
        )
    return out


__all__ = ["choose_num_splits", "dequantize_values", "paged_decode_attention", "paged_decode_attention_ref"]
