"""The engine's `paged_attention` on the Triton kernels: same arguments, same result.

`meta` is a `pdserve.models.attention.AttentionMetadata`, read by attribute only (no import, so
the models package may import this module lazily without a cycle).
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.kernels.chunked_prefill import chunked_prefill_attention
from pdserve.kernels.paged_decode import paged_decode_attention
from pdserve.kernels.store_kvcache import store_kvcache_triton


def prefill_inputs(
    prefills: tuple[Any, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """PrefillChunks (packed one after another) -> cu_seqlens_q [N+1] (relative to the first
    chunk), context_lens [N], block_tables [N, W] (padded with 0) and the longest chunk."""
    first = prefills[0].query_start
    bounds = [0]
    for chunk in prefills:
        if chunk.query_start - first != bounds[-1]:
            raise ValueError("prefill chunks must be packed one after another")
        bounds.append(bounds[-1] + chunk.query_len)
    cu_seqlens_q = torch.tensor(bounds, dtype=torch.int32, device=device)
    context_lens = torch.tensor([chunk.context_len for chunk in prefills], dtype=torch.int32, device=device)
    tables = [chunk.block_table.to(device) for chunk in prefills]
    block_tables = torch.nn.utils.rnn.pad_sequence(tables, batch_first=True)
    return cu_seqlens_q, context_lens, block_tables, max(chunk.query_len for chunk in prefills)


def paged_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: Any, scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. q: [T, H, Dh]; k, v: [T, Hkv, Dh]."""
    store_kvcache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    for group in meta.decode_groups:
        rows = slice(group.start, group.start + group.num_seqs)
        paged_decode_attention(
            q[rows], k_cache, v_cache, group.block_tables, group.context_lens, scale,
            max_context_len=group.max_context_len, out=out[rows],
        )
    if meta.prefills:
        first = meta.prefills[0].query_start
        cu_seqlens_q, context_lens, block_tables, max_query_len = prefill_inputs(meta.prefills, q.device)
        end = meta.prefills[-1].query_start + meta.prefills[-1].query_len
        chunked_prefill_attention(
            q[first:end], k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
            max_query_len=max_query_len, out=out[first:end],
        )
    return out
