"""Quantized KV caches in the Triton kernels against their torch references (CPU interpreter).

int8 across head dims, block sizes and GQA ratios: the store kernel must write the same bytes as the
torch quantizer; decode and chunked prefill must match the references over the dequantized caches.
fp8 e4m3: the read kernels (bitcast + upcast) are checked; the interpreter's fp32 -> fp8 cast is wrong
(see store_kvcache_triton), so the fp8 store is only compiled on CUDA.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.kernels.chunked_prefill import chunked_prefill_attention, chunked_prefill_attention_ref
from pdserve.kernels.paged_attention import paged_attention_triton
from pdserve.kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref
from pdserve.kernels.store_kvcache import store_kvcache_ref, store_kvcache_triton
from pdserve.kernels.testing import assert_close, mixed_step, paged_inputs, quantized_caches
from pdserve.kvcache.quant import quantized_views
from pdserve.models.attention import paged_attention

# (head_dim, block_size, num_kv_heads, group): every head dim and block size meets every GQA ratio once
SHAPES = [
    (hd, bs, hkv, g)
    for (hd, bs), (hkv, g) in zip(itertools.product([64, 128, 80, 32], [16, 32]), itertools.cycle([(1, 1), (2, 4), (1, 8), (3, 3)]))
]


def _byte_pools(num_blocks, block_size, num_kv_heads, head_dim, kv_cache_dtype):
    nbytes = 2 * 2 * block_size * num_kv_heads * (head_dim + 2)
    pools = [torch.zeros(num_blocks, nbytes, dtype=torch.uint8) for _ in range(2)]
    return pools, [quantized_views(p, 2, block_size, num_kv_heads, head_dim, kv_cache_dtype)[1] for p in pools]


@pytest.mark.parametrize("head_dim,block_size,num_kv_heads,group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_store_writes_the_same_bytes_as_the_torch_quantizer(head_dim, block_size, num_kv_heads, group, dtype):
    gen = torch.Generator().manual_seed(head_dim + block_size)
    num_blocks, num_tokens = 6, 37
    (ours, theirs), (ours_kv, theirs_kv) = _byte_pools(num_blocks, block_size, num_kv_heads, head_dim, "int8")
    # strided views, as after the qkv split; one row all zeros, one tiny
    k = (torch.randn(num_tokens, num_kv_heads + 2, head_dim, generator=gen) * 4)[:, 1:-1].to(dtype)
    v = torch.randn(num_tokens, num_kv_heads + 2, head_dim, generator=gen)[:, 1:-1].to(dtype)
    k[5] = 0
    v[7] *= 1e-6
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[11] = -1
    store_kvcache_triton(k, v, *ours_kv, slots)
    store_kvcache_ref(k, v, *theirs_kv, slots)
    assert torch.equal(ours, theirs)
    assert ours.count_nonzero() > 0


def test_fp8_store_is_refused_under_the_interpreter():
    _, (kv, _) = _byte_pools(2, 16, 1, 64, "fp8_e4m3")
    with pytest.raises(NotImplementedError, match="fp8"):
        store_kvcache_triton(torch.randn(1, 1, 64), torch.randn(1, 1, 64), *kv, torch.tensor([3]))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("head_dim,block_size,num_kv_heads,group", SHAPES)
def test_decode_dequantizes_like_the_reference(kv_cache_dtype, head_dim, block_size, num_kv_heads, group):
    dtype = (torch.float32, torch.bfloat16)[head_dim % 3 == 0]
    lens = [1, block_size, 3 * block_size - 5, 150]
    x = paged_inputs([1] * len(lens), lens, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, decode=True, seed=head_dim)
    k_q, v_q = quantized_caches(x.k_cache, x.v_cache, kv_cache_dtype)
    expected = paged_decode_attention_ref(x.q, k_q, v_q, x.block_tables, x.context_lens, x.scale)
    for num_splits in (1, 3):
        out = paged_decode_attention(x.q, k_q, v_q, x.block_tables, x.context_lens, x.scale, num_splits=num_splits)
        assert out.dtype == dtype
        assert_close(out, expected, dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("head_dim,block_size,num_kv_heads,group", SHAPES[::2])
def test_chunked_prefill_dequantizes_like_the_reference(kv_cache_dtype, head_dim, block_size, num_kv_heads, group):
    dtype = (torch.float32, torch.bfloat16)[block_size == 32]
    x = paged_inputs([5, 1, 40], [5, 70, 100], num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, seed=block_size)
    k_q, v_q = quantized_caches(x.k_cache, x.v_cache, kv_cache_dtype)
    args = (x.cu_seqlens_q, x.context_lens, x.block_tables, x.scale)
    assert_close(chunked_prefill_attention(x.q, k_q, v_q, *args), chunked_prefill_attention_ref(x.q, k_q, v_q, *args), dtype)


def test_quantized_reference_is_close_to_the_unquantized_one():
    x = paged_inputs([1, 1], [64, 200], num_kv_heads=2, group=4, head_dim=64, block_size=16,
                     dtype=torch.float32, decode=True)
    exact = paged_decode_attention_ref(x.q, x.k_cache, x.v_cache, x.block_tables, x.context_lens, x.scale)
    k_q, v_q = quantized_caches(x.k_cache, x.v_cache, "int8")
    int8 = paged_decode_attention_ref(x.q, k_q, v_q, x.block_tables, x.context_lens, x.scale)
    assert 0 < (int8 - exact).abs().max() < 0.02


@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 128), (3, 64)])
def test_engine_step_on_triton_matches_the_torch_path_with_int8(group, head_dim):
    # decodes and prefill chunks in one step; both paths store (quantize) then attend over the int8 cache
    q, k, v, k_cache, v_cache, meta = mixed_step(
        [1, 9, 33, 70], [7, 20], [7, 50], num_kv_heads=2, group=group, head_dim=head_dim, block_size=16,
        dtype=torch.float32, seed=group,
    )
    (k_a, v_a), (k_b, v_b) = quantized_caches(k_cache, v_cache, "int8"), quantized_caches(k_cache, v_cache, "int8")
    ours = paged_attention_triton(q, k, v, k_a, v_a, meta, head_dim**-0.5)
    theirs = paged_attention(q, k, v, k_b, v_b, meta, head_dim**-0.5)
    assert torch.equal(k_a.data, k_b.data) and torch.equal(v_a.scale, v_b.scale)
    assert_close(ours, theirs, torch.float32)
