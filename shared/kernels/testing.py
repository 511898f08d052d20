"""Random paged-attention inputs for the kernel tests (CPU interpreter and CUDA alike).

Plain torch, no kernel imports: caches are strided views of a kv_pool laid out like the engine's
([num_blocks, num_layers, 2, block_size, Hkv, D]), block tables are random permutations padded
with random (valid) block ids, and queries are strided views of a wider buffer (as after a qkv split).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

TOLERANCES = {  # (atol, rtol) of a kernel against the fp32 reference
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


@dataclass(frozen=True)
class PagedInputs:
    q: torch.Tensor  # decode: [B, H, D]; prefill: [T, H, D] packed chunks
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], block dim strided
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [N, W]
    context_lens: torch.Tensor  # [N]
    query_lens: tuple[int, ...]  # decode: all 1
    cu_seqlens_q: torch.Tensor  # [N+1]
    scale: float

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]


def strided_randn(*shape: int, dtype: torch.dtype, device: str, generator: torch.Generator) -> torch.Tensor:
    # [..., H, D] view of a buffer with 3 extra heads per row: rows strided, inner dims contiguous
    *lead, heads, dim = shape
    buffer = torch.randn(*lead, heads + 3, dim, generator=generator, device=device, dtype=torch.float32)
    return buffer.to(dtype)[..., 1 : heads + 1, :]


def kv_caches(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, 2, 2, block_size, num_kv_heads, head_dim)
    pool = torch.randn(shape, generator=generator, device=device).to(dtype)
    return pool[:, 1, 0], pool[:, 1, 1]


def block_tables(
    context_lens: list[int], block_size: int, num_blocks: int, generator: torch.Generator, device: str,
    dtype: torch.dtype = torch.int64, extra_width: int = 1,
) -> torch.Tensor:
    """Distinct random blocks per sequence, padded to the widest table (+extra) with random ids."""
    needed = [-(-n // block_size) for n in context_lens]
    width = max(needed) + extra_width
    assert sum(needed) <= num_blocks, "pool too small for distinct blocks"
    order = torch.randperm(num_blocks, generator=generator, device="cpu")
    tables = torch.randint(0, num_blocks, (len(context_lens), width), generator=generator)
    start = 0
    for row, n in enumerate(needed):
        tables[row, :n] = order[start : start + n]
        start += n
    return tables.to(device=device, dtype=dtype)


def paged_inputs(
    query_lens: list[int], context_lens: list[int], *, num_kv_heads: int, group: int, head_dim: int,
    block_size: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
    table_dtype: torch.dtype = torch.int64, decode: bool = False,
) -> PagedInputs:
    """Queries of len query_lens[n] at the last positions of context_lens[n] cached tokens."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    assert all(1 <= q <= c for q, c in zip(query_lens, context_lens))
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 3
    k_cache, v_cache = kv_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, gen)
    tables = block_tables(context_lens, block_size, num_blocks, cpu_gen, device, table_dtype)
    num_heads = num_kv_heads * group
    total = len(query_lens) if decode else sum(query_lens)
    q = strided_randn(total, num_heads, head_dim, dtype=dtype, device=device, generator=gen)
    bounds = [0]
    for n in query_lens:
        bounds.append(bounds[-1] + n)
    return PagedInputs(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables,
        context_lens=torch.tensor(context_lens, device=device),
        query_lens=tuple(query_lens),
        cu_seqlens_q=torch.tensor(bounds, device=device, dtype=torch.int32),
        scale=head_dim**-0.5,
    )


def quantized_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_cache_dtype: str) -> tuple:
    """The float caches [num_blocks, block_size, Hkv, D] quantized into a byte pool laid out like the
    engine's (two layers, values then scales per block; layer 1 is returned). -> (k, v) QuantizedCache."""
    from pdserve.kernels.kv_quant import quantize
    from pdserve.kvcache.quant import quantized_views

    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    nbytes = 2 * 2 * block_size * num_kv_heads * (head_dim + 2)
    pool = torch.zeros(num_blocks, nbytes, dtype=torch.uint8, device=k_cache.device)
    k_q, v_q = quantized_views(pool, 2, block_size, num_kv_heads, head_dim, kv_cache_dtype)[1]
    for cache, target in ((k_cache, k_q), (v_cache, v_q)):
        values, scales = quantize(cache, kv_cache_dtype)
        target.data.view(torch.uint8).copy_(values.view(torch.uint8))
        target.scale.copy_(scales)
    return k_q, v_q


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def mixed_step(
    decode_lens: list[int], prefill_query_lens: list[int], prefill_context_lens: list[int], *,
    num_kv_heads: int, group: int, head_dim: int, block_size: int, dtype: torch.dtype,
    device: str = "cpu", seed: int = 0, num_decode_groups: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """One engine step as ModelRunner packs it: decodes (sorted, in padded groups) then prefill
    chunks. Returns q [T, H, D], k, v [T, Hkv, D], k_cache, v_cache and its AttentionMetadata."""
    from pdserve.models.attention import AttentionMetadata, DecodeGroup, PrefillChunk

    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    lens = list(decode_lens) + list(prefill_context_lens)
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    k_cache, v_cache = kv_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, gen)
    tables = block_tables(lens, block_size, num_blocks, cpu_gen, "cpu", extra_width=0)
    num_tokens = len(decode_lens) + sum(prefill_query_lens)
    q, k, v = (
        strided_randn(num_tokens, heads, head_dim, dtype=dtype, device=device, generator=gen)
        for heads in (num_kv_heads * group, num_kv_heads, num_kv_heads)
    )

    def slot(seq: int, pos: int) -> int:
        return int(tables[seq, pos // block_size]) * block_size + pos % block_size

    def used(seq: int, n: int) -> torch.Tensor:
        return tables[seq, : -(-n // block_size)].to(device)

    slots = [slot(i, n - 1) for i, n in enumerate(decode_lens)]
    chunks, start = [], len(decode_lens)
    for j, (q_len, ctx) in enumerate(zip(prefill_query_lens, prefill_context_lens)):
        seq = len(decode_lens) + j
        slots += [slot(seq, p) for p in range(ctx - q_len, ctx)]
        chunks.append(PrefillChunk(start, q_len, ctx, used(seq, ctx)))
        start += q_len
    groups = []
    bounds = [round(i * len(decode_lens) / num_decode_groups) for i in range(num_decode_groups + 1)]
    for lo, hi in itertools.pairwise(bounds):
        if lo == hi:
            continue
        width = -(-max(decode_lens[lo:hi]) // block_size)
        group_tables = torch.zeros(hi - lo, width, dtype=torch.int64, device=device)  # padded with 0
        for row, n in enumerate(decode_lens[lo:hi]):
            group_tables[row, : -(-n // block_size)] = used(lo + row, n)
        lens_t = torch.tensor(decode_lens[lo:hi], device=device)
        groups.append(DecodeGroup(lo, group_tables, lens_t, max(decode_lens[lo:hi])))
    slot_mapping = torch.tensor(slots, device=device)
    meta = AttentionMetadata(slot_mapping, len(decode_lens), tuple(groups), tuple(chunks))
    return q, k, v, k_cache, v_cache, meta
