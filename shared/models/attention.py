"""Attention over the paged KV cache: metadata and the torch path.

Tokens of one forward pass are packed: the first `num_decode_tokens` are decodes
(one per sequence), then the prefill chunks, one after another.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from pdserve.kernels.kv_quant import QuantizedCache, gather_dequantized, store_quantized

# a layer's K or V cache: [num_blocks, block_size, Hkv, Dh] in the model dtype, or int8/fp8 values with scales
KVCache = torch.Tensor | QuantizedCache


@dataclass(frozen=True)
class PrefillChunk:
    query_start: int  # offset of the chunk in the packed token dimension
    query_len: int
    context_len: int  # tokens in cache after this chunk, the chunk included
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass(frozen=True)
class DecodeGroup:
    """Decodes of similar context length, attended together over a padded gather."""

    start: int  # first decode row of the group
    block_tables: torch.Tensor  # [n, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [n] int64, the current token included
    max_context_len: int

    @property
    def num_seqs(self) -> int:
        return self.block_tables.shape[0]

    @cached_property
    def padding(self) -> torch.Tensor | None:
        """[n, 1, S] True past each sequence's context (S = max_context_len); None when nothing is padded."""
        lens = self.context_lens
        if self.num_seqs == 1 or bool((lens == self.max_context_len).all()):
            return None
        return (torch.arange(self.max_context_len, device=lens.device)[None, :] >= lens[:, None])[:, None, :]


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) of each token
    num_decode_tokens: int
    decode_groups: tuple[DecodeGroup, ...]
    prefills: tuple[PrefillChunk, ...]
    # reusable gather buffers (K, V), each [>= max gathered blocks, block_size, Hkv, D]; fresh
    # allocations of this size cost more in page faults than the copy itself on CPU
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None
    backend: str = "torch"  # "triton": the kernels in pdserve.kernels (CUDA, or the interpreter in tests)


def store_kvcache(
    k: torch.Tensor, v: torch.Tensor, k_cache: KVCache, v_cache: KVCache, slot_mapping: torch.Tensor
) -> None:
    # k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (block dim may be strided)
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    if isinstance(k_cache, QuantizedCache):
        store_quantized(k, k_cache, blocks, offsets)
        store_quantized(v, v_cache, blocks, offsets)
        return
    k_cache.index_put_((blocks, offsets), k)
    v_cache.index_put_((blocks, offsets), v)


def gather_blocks(cache: KVCache, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    # cache: [num_blocks, block_size, Hkv, D] -> [length, Hkv, D] in `dtype` (dequantized on the fly)
    if isinstance(cache, QuantizedCache):
        return gather_dequantized(cache, block_table, dtype).flatten(0, 1)[:length]
    return cache.index_select(0, block_table).flatten(0, 1)[:length]


def _gather(cache: KVCache, blocks: torch.Tensor, buffer: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(cache, QuantizedCache):
        return gather_dequantized(cache, blocks, dtype, out=buffer)
    if buffer is None or buffer.shape[0] < blocks.numel():
        return cache.index_select(0, blocks)
    return torch.index_select(cache, 0, blocks, out=buffer[: blocks.numel()])


def decode_attention(
    q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    # q: [D, H, Dh] -> out [D, H, Dh]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group_size = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    # [D, Hkv, G, Dh]: the query heads that share a KV head, side by side
    queries = (q * scale).view(q.shape[0], num_kv_heads, group_size, head_dim)
    outs = out.view(q.shape[0], num_kv_heads, group_size, head_dim)
    block_size = k_cache.shape[1]
    kbuf, vbuf = meta.workspace or (None, None)
    for group in meta.decode_groups:
        n, width = group.block_tables.shape
        span = group.max_context_len
        blocks = group.block_tables.flatten()
        # k, v: [n, S, Hkv, Dh], gathered once; each KV head is then a strided [n, S, Dh] view that
        # bmm reads in place (no transposed copy, no mask over a padded batch for the common case)
        k = _gather(k_cache, blocks, kbuf, q.dtype).view(n, width * block_size, num_kv_heads, head_dim)[:, :span]
        v = _gather(v_cache, blocks, vbuf, q.dtype).view(n, width * block_size, num_kv_heads, head_dim)[:, :span]
        padding = group.padding
        rows = slice(group.start, group.start + n)
        for h in range(num_kv_heads):
            scores = torch.bmm(queries[rows, h], k[:, :, h].transpose(1, 2))  # [n, G, S]
            if padding is not None:
                scores.masked_fill_(padding, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            outs[rows, h] = torch.bmm(probs, v[:, :, h])  # [n, G, Dh]
    return out


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: KVCache, v_cache: KVCache,
    chunk: PrefillChunk, scale: float,
) -> torch.Tensor:
    # q: [Q, H, Dh]; k, v: [Q, Hkv, Dh] (this chunk's keys) -> out [Q, H, Dh]
    num_cached = chunk.context_len - chunk.query_len
    # a quantized cache is always read back (like the Triton kernel), so the chunk sees what decode will
    if num_cached == 0 and not isinstance(k_cache, QuantizedCache):
        keys, values, mask, causal = k, v, None, True
    elif num_cached == 0:
        keys = gather_blocks(k_cache, chunk.block_table, chunk.context_len, q.dtype)
        values = gather_blocks(v_cache, chunk.block_table, chunk.context_len, q.dtype)
        mask, causal = None, True
    else:
        keys = gather_blocks(k_cache, chunk.block_table, chunk.context_len, q.dtype)
        values = gather_blocks(v_cache, chunk.block_table, chunk.context_len, q.dtype)
        query_pos = torch.arange(chunk.query_len, device=q.device)[:, None] + num_cached
        mask = torch.arange(chunk.context_len, device=q.device)[None, :] <= query_pos
        causal = False
    # [1, H, S, Dh]: with a batch dimension the CPU backend picks its flash kernel; 3-D inputs fall back
    # to the math path, several times slower on long prompts
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: KVCache, v_cache: KVCache,
    meta: AttentionMetadata, scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. q: [T, H, Dh]; k, v: [T, Hkv, Dh]."""
    if meta.backend == "triton":
        from pdserve.kernels import paged_attention_triton  # lazy: triton chooses interpreter vs compiler at import

        return paged_attention_triton(q, k, v, k_cache, v_cache, meta, scale)
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
