"""Attention over the paged KV cache: metadata and the torch path.

Tokens of one forward pass are packed: the first `num_decode_tokens` are decodes
(one per sequence), then the prefill chunks, one after another.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu_attention import native_cache, paged_decode, store_kv
from pdserve.kernels.kv_quant import QuantizedCache, gather_dequantized, store_quantized

# a layer's K or V cache: [num_blocks, block_size, Hkv, Dh] in the model dtype or float16 (written rounded,
# read back as the model dtype), or int8/fp8 values with scales
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
    if native_cache(k_cache, v_cache) and store_kv(k, v, k_cache, v_cache, slot_mapping):
        return
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    if isinstance(k_cache, QuantizedCache):
        store_quantized(k, k_cache, blocks, offsets)
        store_quantized(v, v_cache, blocks, offsets)
        return
    k_cache.index_put_((blocks, offsets), k.to(k_cache.dtype))
    v_cache.index_put_((blocks, offsets), v.to(v_cache.dtype))


def gather_blocks(cache: KVCache, block_table: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    # cache: [num_blocks, block_size, Hkv, D] -> [length, Hkv, D] in `dtype` (dequantized on the fly)
    if isinstance(cache, QuantizedCache):
        return gather_dequantized(cache, block_table, dtype).flatten(0, 1)[:length]
    return cache.index_select(0, block_table).flatten(0, 1)[:length].to(dtype)


def _gather(cache: KVCache, blocks: torch.Tensor, buffer: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(cache, QuantizedCache):
        return gather_dequantized(cache, blocks, dtype, out=buffer)
    if cache.dtype is not dtype:
        gathered = cache.index_select(0, blocks)
        if buffer is None or buffer.shape[0] < blocks.numel() or buffer.dtype is not dtype:
            return gathered.to(dtype)
        return buffer[: blocks.numel()].copy_(gathered)
    if buffer is None or buffer.shape[0] < blocks.numel():
        return cache.index_select(0, blocks)
    return torch.index_select(cache, 0, blocks, out=buffer[: blocks.numel()])


# Query heads per KV head from which decode attends per KV head with bmm: at 4 (8 heads over 2) that beat
# one padded SDPA call by 1.1-1.4x on batches here; at 3 (SmolLM2's 9 over 3) it lost at most sizes
# (`pdserve bench attention`)
BMM_MIN_GROUP_SIZE = 4


def decode_attention(
    q: torch.Tensor, k_cache: KVCache, v_cache: KVCache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    # q: [D, H, Dh] -> out [D, H, Dh]
    if q.dtype is torch.float32 and native_cache(k_cache, v_cache):
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            rows = slice(group.start, group.start + group.num_seqs)
            out[rows] = paged_decode(q[rows], k_cache, v_cache, group.block_tables, group.context_lens, scale)
        return out
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    attend = _attend_bmm if q.shape[1] // num_kv_heads >= BMM_MIN_GROUP_SIZE else _attend_sdpa
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    kbuf, vbuf = meta.workspace or (None, None)
    for group in meta.decode_groups:
        n, width = group.block_tables.shape
        blocks = group.block_tables.flatten()
        # k, v: [n, S, Hkv, Dh], gathered once into the reused workspace
        shape = (n, width * block_size, num_kv_heads, head_dim)
        k = _gather(k_cache, blocks, kbuf, q.dtype).view(shape)[:, : group.max_context_len]
        v = _gather(v_cache, blocks, vbuf, q.dtype).view(shape)[:, : group.max_context_len]
        rows = slice(group.start, group.start + n)
        out[rows] = attend(q[rows], k, v, group, scale)
    return out


def _attend_bmm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup, scale: float) -> torch.Tensor:
    # q: [n, H, Dh]; k, v: [n, S, Hkv, Dh]. Each KV head is a strided [n, S, Dh] view that bmm reads in
    # place: no transposed copy, and a mask only when lengths differ
    n, num_kv_heads, head_dim = q.shape[0], k.shape[2], k.shape[3]
    queries = (q * scale).view(n, num_kv_heads, -1, head_dim)  # [n, Hkv, G, Dh]
    out = torch.empty_like(queries)
    for h in range(num_kv_heads):
        scores = torch.bmm(queries[:, h], k[:, :, h].transpose(1, 2))  # [n, G, S]
        if group.padding is not None:
            scores.masked_fill_(group.padding, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        torch.bmm(probs, v[:, :, h], out=out[:, h])  # [n, G, Dh]
    return out.view_as(q)


def _attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: DecodeGroup, scale: float) -> torch.Tensor:
    # q: [n, H, Dh]; k, v: [n, S, Hkv, Dh] -> one SDPA call over the padded batch
    mask = None
    if group.padding is not None:
        mask = ~group.padding[:, :, None, :]  # [n, 1, 1, S], True where a key is attended
    return F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          scale=scale, enable_gqa=True).squeeze(2)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: KVCache, v_cache: KVCache,
    chunk: PrefillChunk, scale: float,
) -> torch.Tensor:
    # q: [Q, H, Dh]; k, v: [Q, Hkv, Dh] (this chunk's keys) -> out [Q, H, Dh]
    num_cached = chunk.context_len - chunk.query_len
    # a quantized or float16 cache is always read back (like the Triton kernel), so the chunk sees what
    # decode will
    if num_cached == 0 and not isinstance(k_cache, QuantizedCache) and k_cache.dtype is q.dtype:
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
