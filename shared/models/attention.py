"""Attention over the paged KV cache: metadata and the torch path.

Tokens of one forward pass are packed: the first `num_decode_tokens` are decodes
(one per sequence), then the prefill chunks, one after another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillChunk:
    query_start: int  # offset of the chunk in the packed token dimension
    query_len: int
    context_len: int  # tokens in cache after this chunk, the chunk included
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) of each token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor | None  # [D] int64, the current token included
    decode_max_context_len: int
    prefills: tuple[PrefillChunk, ...]


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    # k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (block dim may be strided)
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache.index_put_((blocks, offsets), k)
    v_cache.index_put_((blocks, offsets), v)


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    # cache: [num_blocks, block_size, Hkv, D] -> [length, Hkv, D]
    return cache.index_select(0, block_table).flatten(0, 1)[:length]


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    # q: [D, H, Dh] -> out [D, H, Dh]
    num_seqs, max_blocks = meta.decode_block_tables.shape
    block_size = k_cache.shape[1]
    span = meta.decode_max_context_len
    k = k_cache.index_select(0, meta.decode_block_tables.flatten()).view(num_seqs, max_blocks * block_size, *k_cache.shape[2:])
    v = v_cache.index_select(0, meta.decode_block_tables.flatten()).view(num_seqs, max_blocks * block_size, *v_cache.shape[2:])
    # k, v: [D, S, Hkv, Dh] -> [D, Hkv, S, Dh]
    k = k[:, :span].transpose(1, 2)
    v = v[:, :span].transpose(1, 2)
    mask = None
    if num_seqs > 1:
        positions = torch.arange(span, device=q.device)
        mask = (positions[None, :] < meta.decode_context_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    chunk: PrefillChunk, scale: float,
) -> torch.Tensor:
    # q: [Q, H, Dh]; k, v: [Q, Hkv, Dh] (this chunk's keys) -> out [Q, H, Dh]
    num_cached = chunk.context_len - chunk.query_len
    if num_cached == 0:
        keys, values, mask, causal = k, v, None, True
    else:
        keys = gather_blocks(k_cache, chunk.block_table, chunk.context_len)
        values = gather_blocks(v_cache, chunk.block_table, chunk.context_len)
        query_pos = torch.arange(chunk.query_len, device=q.device)[:, None] + num_cached
        mask = torch.arange(chunk.context_len, device=q.device)[None, :] <= query_pos
        causal = False
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. q: [T, H, Dh]; k, v: [T, Hkv, Dh]."""
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    num_decode = meta.num_decode_tokens
    if not meta.prefills:
        return decode_attention(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if num_decode:
        out[:num_decode] = decode_attention(q[:num_decode], k_cache, v_cache, meta, scale)
    for chunk in meta.prefills:
        rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        out[rows] = prefill_attention(q[rows], k[rows], v[rows], k_cache, v_cache, chunk, scale)
    return out
