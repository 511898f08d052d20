import itertools
import random

import pytest
import torch

from pdserve.kernels.chunked_prefill import chunked_prefill_attention, chunked_prefill_attention_ref
from pdserve.kernels.testing import PagedInputs, assert_close, paged_inputs
from pdserve.models.attention import PrefillChunk, prefill_attention

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# every dtype x GQA ratio twice; head_dim and block_size cycle through all four pairs
CASES = [
    (i, dtype, group, (64, 128)[i % 2], (16, 32)[i // 2 % 2])
    for i, (_, dtype, group) in enumerate(itertools.product(range(2), DTYPES, [1, 4, 8]))
]


def _prefill_inputs(seed, dtype, group, head_dim, block_size):
    rng = random.Random(seed)
    num_chunks = rng.choice([1, 2, 3])
    query_lens = [rng.randint(1, 80) for _ in range(num_chunks)]
    cached = [rng.choice([0, rng.randint(1, 200)]) for _ in range(num_chunks)]
    query_lens[0] = (1, 1, block_size + 3, 20)[seed % 4]
    cached[0] = (0, 37, 0, block_size)[seed % 4]  # first chunk, decode-like, off-block, block-aligned
    context_lens = [q + c for q, c in zip(query_lens, cached)]
    return paged_inputs(
        query_lens, context_lens, num_kv_heads=rng.choice([1, 2]), group=group, head_dim=head_dim,
        block_size=block_size, dtype=dtype, seed=seed, table_dtype=(torch.int64, torch.int32)[seed % 2],
    )


def _run(x: PagedInputs, **kw) -> torch.Tensor:
    return chunked_prefill_attention(
        x.q, x.k_cache, x.v_cache, x.cu_seqlens_q, x.context_lens, x.block_tables, x.scale, **kw
    )


@pytest.mark.parametrize("seed,dtype,group,head_dim,block_size", CASES)
def test_prefill_matches_reference(seed, dtype, group, head_dim, block_size):
    x = _prefill_inputs(seed, dtype, group, head_dim, block_size)
    out = _run(x, max_query_len=max(x.query_lens) if seed % 2 else None)
    expected = chunked_prefill_attention_ref(
        x.q, x.k_cache, x.v_cache, x.cu_seqlens_q, x.context_lens, x.block_tables, x.scale
    )
    assert out.dtype == dtype and out.shape == x.q.shape
    assert_close(out, expected, dtype)


def test_queries_see_no_later_keys():
    # poisoning every key after the last query's position must not change any output
    x = paged_inputs([9], [9], num_kv_heads=1, group=4, head_dim=64, block_size=16, dtype=torch.float32)
    before = _run(x)
    x.v_cache[x.block_tables[0, 0], 5:] = 1e4  # keys 5.. of the chunk: visible to queries 5.. only
    after = _run(x)
    torch.testing.assert_close(after[:5], before[:5])
    assert (after[5:] - before[5:]).abs().min() > 1


@pytest.mark.parametrize("dtype,group", [(torch.float32, 4), (torch.bfloat16, 8), (torch.float16, 1)])
def test_prefill_agrees_with_engine_torch_path(dtype, group):
    query_lens, context_lens = [7, 16, 3], [7, 50, 36]  # fresh prompt, then two chunks over cached prefixes
    x = paged_inputs(query_lens, context_lens, num_kv_heads=2, group=group, head_dim=64, block_size=16,
                     dtype=dtype, seed=group)
    engine = torch.empty_like(x.q)
    for n, (q_len, ctx) in enumerate(zip(query_lens, context_lens)):
        rows = slice(int(x.cu_seqlens_q[n]), int(x.cu_seqlens_q[n + 1]))
        table = x.block_tables[n, : -(-ctx // 16)].long()
        positions = torch.arange(ctx - q_len, ctx)
        k = x.k_cache[table].flatten(0, 1)[positions]  # the chunk's own keys, already in the cache
        v = x.v_cache[table].flatten(0, 1)[positions]
        chunk = PrefillChunk(rows.start, q_len, ctx, table)
        engine[rows] = prefill_attention(x.q[rows], k, v, x.k_cache, x.v_cache, chunk, x.scale)
    assert_close(_run(x), engine, dtype)


@pytest.mark.parametrize("group,head_dim", [(1, 64), (8, 128)])
@pytest.mark.parametrize("cached", [62, 63, 64, 127])
def test_tile_edges_of_the_unmasked_key_range(group, head_dim, cached):
    # first query positions around a multiple of the 64-key tile: the causal mask starts exactly there
    x = paged_inputs([9, 3], [cached + 9, 66], num_kv_heads=1, group=group, head_dim=head_dim, block_size=16,
                     dtype=torch.float32, seed=cached)
    expected = chunked_prefill_attention_ref(
        x.q, x.k_cache, x.v_cache, x.cu_seqlens_q, x.context_lens, x.block_tables, x.scale
    )
    assert_close(_run(x), expected, torch.float32)


@pytest.mark.parametrize("head_dim,block_size", [(80, 16), (32, 8)])
def test_other_head_dims_and_block_sizes(head_dim, block_size):
    x = paged_inputs([20, 7], [20, 90], num_kv_heads=2, group=2, head_dim=head_dim, block_size=block_size,
                     dtype=torch.float32, seed=head_dim)
    expected = chunked_prefill_attention_ref(
        x.q, x.k_cache, x.v_cache, x.cu_seqlens_q, x.context_lens, x.block_tables, x.scale
    )
    assert_close(_run(x), expected, torch.float32)
