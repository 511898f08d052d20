"""The kernel checks of tests/unit/kernels, compiled on CUDA with larger shapes.

Run in a pytest session of its own (`pytest -m gpu tests/gpu`): tests/unit/kernels turns on the
Triton interpreter for the whole session, and triton.jit picks interpreter or compiler once, at
import of the kernel modules. Kernel modules are imported inside the tests for the same reason.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from pdserve.kernels.testing import assert_close, mixed_step, paged_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASES = [
    (i, dtype, group, (64, 128)[i % 2], (16, 32)[i // 2 % 2])
    for i, (_, dtype, group) in enumerate(itertools.product(range(2), DTYPES, [1, 4, 8]))
]


@pytest.fixture(scope="module")
def kernels():
    import triton

    if triton.knobs.runtime.interpret:
        pytest.skip("TRITON_INTERPRET is on in this session: run tests/gpu in a pytest session of its own")
    from pdserve import kernels

    return kernels


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kvcache(kernels, dtype, block_size):
    gen = torch.Generator(device="cuda").manual_seed(block_size)
    num_blocks, num_tokens = 400, 3000
    pool = torch.randn(num_blocks, 2, 2, block_size, 8, 128, device="cuda", generator=gen).to(dtype)
    qkv = torch.randn(num_tokens, 48, 128, device="cuda", generator=gen).to(dtype)
    k, v = qkv[:, 32:40], qkv[:, 40:48]  # strided, as after the qkv split
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:num_tokens]
    slots[::7] = -1
    expected = pool.clone()
    kernels.store_kvcache_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    kernels.store_kvcache_triton(k, v, pool[:, 1, 0], pool[:, 1, 1], slots)
    assert torch.equal(pool, expected)


@pytest.mark.parametrize("seed,dtype,group,head_dim,block_size", CASES)
def test_paged_decode(kernels, seed, dtype, group, head_dim, block_size):
    rng = random.Random(seed)
    batch = rng.choice([1, 7, 33, 64])
    lens = [rng.randint(1, 6000) for _ in range(batch)]
    lens[0] = (1, block_size, block_size + 1, 4097)[seed % 4]
    x = paged_inputs([1] * batch, lens, num_kv_heads=rng.choice([2, 8]), group=group, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, device="cuda", seed=seed, decode=True,
                     table_dtype=(torch.int64, torch.int32)[seed % 2])
    args = (x.q, x.k_cache, x.v_cache, x.block_tables, x.context_lens, x.scale)
    expected = kernels.paged_decode_attention_ref(*args)
    for num_splits in (None, 1, 4, 16):
        assert_close(kernels.paged_decode_attention(*args, num_splits=num_splits), expected, dtype)


@pytest.mark.parametrize("seed,dtype,group,head_dim,block_size", CASES)
def test_chunked_prefill(kernels, seed, dtype, group, head_dim, block_size):
    rng = random.Random(seed)
    num_chunks = rng.choice([1, 2, 4])
    query_lens = [rng.randint(1, 700) for _ in range(num_chunks)]
    context_lens = [q + rng.choice([0, rng.randint(1, 3000)]) for q in query_lens]
    x = paged_inputs(query_lens, context_lens, num_kv_heads=rng.choice([2, 8]), group=group,
                     head_dim=head_dim, block_size=block_size, dtype=dtype, device="cuda", seed=seed,
                     table_dtype=(torch.int64, torch.int32)[seed % 2])
    args = (x.q, x.k_cache, x.v_cache, x.cu_seqlens_q, x.context_lens, x.block_tables, x.scale)
    expected = kernels.chunked_prefill_attention_ref(*args)
    assert_close(kernels.chunked_prefill_attention(*args), expected, dtype)


@pytest.mark.parametrize("dtype,group", [(torch.bfloat16, 4), (torch.float16, 8), (torch.float32, 1)])
def test_paged_attention_agrees_with_engine(kernels, dtype, group):
    from pdserve.models.attention import paged_attention

    rng = random.Random(group)
    decode_lens = sorted(rng.randint(1, 3000) for _ in range(40))
    q, k, v, k_cache, v_cache, meta = mixed_step(
        decode_lens, [300, 77], [300, 1500], num_kv_heads=8, group=group, head_dim=128, block_size=16,
        dtype=dtype, device="cuda", seed=group, num_decode_groups=4,
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = paged_attention(q, k, v, k_ref, v_ref, meta, 128**-0.5)
    out = kernels.paged_attention_triton(q, k, v, k_cache, v_cache, meta, 128**-0.5)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert_close(out, expected, dtype)


def test_pool_past_int32_offsets(kernels):
    # a pool of more than 2**31 elements: the last blocks need 64-bit offsets
    num_blocks, block_size = 34_000, 16
    pool = torch.zeros(num_blocks, 2, 2, block_size, 8, 128, device="cuda", dtype=torch.bfloat16)
    assert pool.numel() > 2**31
    k_cache, v_cache = pool[:, 1, 0], pool[:, 1, 1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = 40
    k = torch.randn(tokens, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(tokens, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
    table = torch.tensor([[num_blocks - 1, num_blocks - 3, num_blocks - 2]], device="cuda")
    slots = torch.cat([table[0, i] * block_size + torch.arange(16, device="cuda") for i in range(3)])[:tokens]
    kernels.store_kvcache_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[num_blocks - 1], k[:16]) and torch.equal(v_cache[num_blocks - 2, :8], v[32:40])
    q = torch.randn(1, 32, 128, device="cuda", generator=gen).to(torch.bfloat16)
    lens = torch.tensor([tokens], device="cuda")
    out = kernels.paged_decode_attention(q, k_cache, v_cache, table, lens, 128**-0.5, num_splits=2)
    expected = kernels.paged_decode_attention_ref(q, k_cache, v_cache, table, lens, 128**-0.5)
    assert_close(out, expected, torch.bfloat16)
