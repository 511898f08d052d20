"""Chunked-prefill attention: packed variable-length query chunks over the paged KV cache.

Chunk n holds queries cu_seqlens_q[n]:cu_seqlens_q[n+1]; its keys are the first context_lens[n]
cache positions of block_tables[n], the chunk's own K/V included (stored before the call). Query i
of a chunk of length L sits at position context_len - L + i and sees keys at positions <= its own.

Grid (N, query tiles, Hkv): a program takes QUERIES_PER_TILE queries times the `group` query heads
of one KV head as the rows of one [BLOCK_M, D] tile (row r = query r // group, head r % group), so
each K/V tile is read once per group. Keys before the tile's first query position are visible to
every row and need no causal mask; only the tail of the key range is masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import cache_operands, needs_upcast
from pdserve.kernels.kv_quant import QuantizedCache, dequantized_cache
from pdserve.kernels.paged_decode import dequantize_values

LOG2E = 1.4426950408889634


def chunked_prefill_attention_ref(
    q: torch.Tensor, k_cache: torch.Tensor | QuantizedCache, v_cache: torch.Tensor | QuantizedCache,
    cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
) -> torch.Tensor:
    # q: [T, H, D]; caches: [num_blocks, block_size, Hkv, D] (quantized: dequantized first); block_tables: [N, W]
    group = q.shape[1] // k_cache.shape[2]
    k_cache, v_cache = dequantized_cache(k_cache), dequantized_cache(v_cache)
    out = torch.empty_like(q)
    for n in range(context_lens.shape[0]):
        start, end, ctx = int(cu_seqlens_q[n]), int(cu_seqlens_q[n + 1]), int(context_lens[n])
        k = k_cache[block_tables[n]].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
        v = v_cache[block_tables[n]].flatten(0, 1)[:ctx].float().repeat_interleave(group, dim=1)
        query_pos = torch.arange(ctx - (end - start), ctx, device=q.device)[:, None]
        visible = torch.arange(ctx, device=q.device)[None, :] <= query_pos  # [L, ctx]
        scores = torch.einsum("lhd,khd->hlk", q[start:end].float(), k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hlk,khd->lhd", scores.softmax(-1), v).to(q.dtype)
    return out


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, qk_scale, query_pos, k_cache_ptr, v_cache_ptr, table, kv_head, key_start, key_end,
    stride_kb, stride_ko, stride_kh, stride_kd, stride_vb, stride_vo, stride_vh, stride_vd, stride_tw,
    d, d_mask, k_scale_ptr, v_scale_ptr, stride_ksb, stride_kso, stride_ksh, stride_vsb, stride_vso, stride_vsh,
    CAUSAL: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
):
    # online softmax over keys [key_start, key_end); scores in the log2 domain (qk_scale has log2(e))
    for tile in range(key_start, key_end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        valid = pos < key_end
        block = tl.load(table + (pos // BLOCK_SIZE) * stride_tw, mask=valid, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        k_rows = block * stride_kb + offset * stride_ko + kv_head * stride_kh
        v_rows = block * stride_vb + offset * stride_vo + kv_head * stride_vh
        kv_mask = valid[:, None] & d_mask[None, :]
        # k, v: [N, D]
        k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :] * stride_kd, mask=kv_mask, other=0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :] * stride_vd, mask=kv_mask, other=0)
        if QUANT:
            # dequantize on the fly with the per-(token, KV head) scales [N]
            k_s = tl.load(k_scale_ptr + block * stride_ksb + offset * stride_kso + kv_head * stride_ksh,
                          mask=valid, other=0.0)
            v_s = tl.load(v_scale_ptr + block * stride_vsb + offset * stride_vso + kv_head * stride_vsh,
                          mask=valid, other=0.0)
            k = (dequantize_values(k, QUANT) * k_s.to(tl.float32)[:, None]).to(q.dtype)
            v = (dequantize_values(v, QUANT) * v_s.to(tl.float32)[:, None]).to(q.dtype)
        elif UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [M, N]
        if CAUSAL:
            s = tl.where(valid[None, :] & (pos[None, :] <= query_pos[:, None]), s, float("-inf"))
        else:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _chunked_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, cu_seqlens_ptr, context_lens_ptr, block_tables_ptr,
    k_scale_ptr, v_scale_ptr, qk_scale,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_tb, stride_tw,
    stride_ksb, stride_kso, stride_ksh, stride_vsb, stride_vso, stride_vsh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUERIES_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_begin = tl.load(cu_seqlens_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int32) - q_begin
    first_query = q_tile * QUERIES_PER_TILE
    if first_query >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    num_cached = context_len - q_len

    r = tl.arange(0, BLOCK_M)
    query = first_query + r // GROUP  # [M] index within the chunk
    head = kv_head * GROUP + r % GROUP
    row_mask = (r < QUERIES_PER_TILE * GROUP) & (query < q_len)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    token = (q_begin + query).to(tl.int64)
    q_mask = row_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=q_mask, other=0.0)  # [M, D]
    if UPCAST:
        q = q.to(tl.float32)
    query_pos = num_cached + query

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_tb
    # keys below the tile's first query position are seen by every row: whole tiles there skip the mask
    unmasked_end = ((num_cached + first_query + 1) // BLOCK_N) * BLOCK_N
    last_query = tl.minimum(first_query + QUERIES_PER_TILE, q_len) - 1
    key_end = num_cached + last_query + 1
    acc, m_i, l_i = _attend_tile(
        acc, m_i, l_i, q, qk_scale, query_pos, k_cache_ptr, v_cache_ptr, table, kv_head,
        0, unmasked_end,
        stride_kb, stride_ko, stride_kh, stride_kd, stride_vb, stride_vo, stride_vh, stride_vd, stride_tw,
        d, d_mask, k_scale_ptr, v_scale_ptr, stride_ksb, stride_kso, stride_ksh, stride_vsb, stride_vso, stride_vsh,
        False, BLOCK_SIZE, BLOCK_N, UPCAST, QUANT,
    )
    acc, m_i, l_i = _attend_tile(
        acc, m_i, l_i, q, qk_scale, query_pos, k_cache_ptr, v_cache_ptr, table, kv_head,
        unmasked_end, key_end,
        stride_kb, stride_ko, stride_kh, stride_kd, stride_vb, stride_vo, stride_vh, stride_vd, stride_tw,
        d, d_mask, k_scale_ptr, v_scale_ptr, stride_ksb, stride_kso, stride_ksh, stride_vsb, stride_vso, stride_vsh,
        True, BLOCK_SIZE, BLOCK_N, UPCAST, QUANT,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def chunked_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
    max_query_len: int | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D] packed chunks (any strides); caches may be QuantizedCache (dequantized on the fly); cu_seqlens_q: [N+1]; context_lens: [N] (cache
    tokens after each chunk, the chunk included); block_tables: [N, W]. Pass `max_query_len` to
    avoid a host sync. Returns out [T, H, D] (written into `out` when given)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    k_data, k_scale, k_scale_strides, quant = cache_operands(k_cache)
    v_data, v_scale, v_scale_strides, _ = cache_operands(v_cache)
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    num_seqs = context_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group = num_heads // num_kv_heads
    block_m = max(triton.next_power_of_2(group), 128 if head_dim <= 64 else 64)
    queries_per_tile = block_m // group
    block_n = max(block_size, 64)
    grid = (num_seqs, triton.cdiv(max_query_len, queries_per_tile), num_kv_heads)
    _chunked_prefill_kernel[grid](
        q, k_data, v_data, out, cu_seqlens_q, context_lens, block_tables, k_scale, v_scale,
        scale * LOG2E,
        *q.stride(), *k_data.stride(), *v_data.stride(), *out.stride(), *block_tables.stride(),
        *k_scale_strides, *v_scale_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, QUERIES_PER_TILE=queries_per_tile,
        BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_N=block_n,
        UPCAST=needs_upcast(q, k_cache), QUANT=quant, num_warps=4,
    )
    return out
