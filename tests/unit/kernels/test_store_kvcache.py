import pytest
import torch

from pdserve.kernels.store_kvcache import store_kvcache_ref, store_kvcache_triton
from pdserve.kernels.testing import strided_randn
from pdserve.models.attention import store_kvcache

CASES = [  # (dtype, block_size, num_kv_heads, head_dim)
    (torch.float32, 16, 2, 64),
    (torch.bfloat16, 32, 1, 128),
    (torch.float16, 16, 3, 128),
    (torch.bfloat16, 16, 8, 64),
]


def _setup(dtype, block_size, num_kv_heads, head_dim, num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 6
    # the engine's pool layout: caches of layer 1 are strided views
    pool = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    k = strided_randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device="cpu", generator=gen)
    v = strided_randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device="cpu", generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    return pool, k, v, slots


@pytest.mark.parametrize("dtype,block_size,num_kv_heads,head_dim", CASES)
def test_store_matches_reference_and_skips_negative_slots(dtype, block_size, num_kv_heads, head_dim):
    pool, k, v, slots = _setup(dtype, block_size, num_kv_heads, head_dim, num_tokens=11, seed=head_dim)
    slots[[2, 7]] = -1
    original, expected = pool.clone(), pool.clone()
    store_kvcache_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots)
    store_kvcache_triton(k, v, pool[:, 1, 0], pool[:, 1, 1], slots)
    assert torch.equal(pool, expected)
    assert torch.equal(pool[:, 0], original[:, 0])  # the other layer is untouched
    changed = (pool[:, 1, 0] != original[:, 1, 0]).flatten(2).any(-1).flatten()  # [num_blocks * block_size]
    assert set(changed.nonzero().flatten().tolist()) == set(slots[slots >= 0].tolist())


def test_store_agrees_with_engine_path():
    pool, k, v, slots = _setup(torch.bfloat16, 16, 4, 64, num_tokens=23, seed=3)
    expected = pool.clone()
    store_kvcache(k, v, expected[:, 0, 0], expected[:, 0, 1], slots)
    store_kvcache_triton(k, v, pool[:, 0, 0], pool[:, 0, 1], slots)
    assert torch.equal(pool, expected)


def test_store_nothing_for_empty_batch():
    pool, k, v, slots = _setup(torch.float32, 16, 2, 64, num_tokens=0, seed=0)
    before = pool.clone()
    store_kvcache_triton(k, v, pool[:, 0, 0], pool[:, 0, 1], slots)
    assert torch.equal(pool, before)
