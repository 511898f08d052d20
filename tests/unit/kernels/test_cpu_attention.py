"""The native decode attention and KV store over the paged float32 cache (pdserve.kernels.cpu_attention)
against torch's path in pdserve.models.attention, on the same caches."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_attention import native_cache, paged_decode, store_kv
from pdserve.models.attention import AttentionMetadata, DecodeGroup, decode_attention, store_kvcache

if cpu_native.library() is None:
    pytest.skip(f"native kernels not built: {cpu_native.unavailable_reason()}", allow_module_level=True)

NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM = 32, 16, 3, 64


def _caches(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


@pytest.mark.parametrize("heads", [3, 9, 12])  # MHA, GQA 3, GQA 4 (torch's bmm path)
@pytest.mark.parametrize("lens", [[1], [16], [37, 100, 5], [200, 200]])
def test_decode_attention_matches_torchs_path(monkeypatch, heads: int, lens: list[int]) -> None:
    k_cache, v_cache = _caches(len(lens) + heads)
    gen = torch.Generator().manual_seed(heads)
    width = max((n + BLOCK - 1) // BLOCK for n in lens)
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=gen)[:width] for _ in lens])
    q = torch.randn(len(lens), heads, HEAD_DIM, generator=gen)
    group = DecodeGroup(0, tables, torch.tensor(lens), max(lens))
    meta = AttentionMetadata(slot_mapping=torch.arange(len(lens)), num_decode_tokens=len(lens),
                             decode_groups=(group,), prefills=())
    native = decode_attention(q, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    monkeypatch.setenv(cpu_native.KERNEL_ENV, "torch")
    reference = decode_attention(q, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    assert (native - reference).abs().max() < 1e-5


def test_two_groups_fill_their_own_rows() -> None:
    k_cache, v_cache = _caches(0)
    q = torch.randn(3, 9, HEAD_DIM)
    groups = (DecodeGroup(0, torch.tensor([[4, 5]]), torch.tensor([20]), 20),
              DecodeGroup(1, torch.tensor([[7], [9]]), torch.tensor([3, 16]), 16))
    meta = AttentionMetadata(slot_mapping=torch.arange(3), num_decode_tokens=3, decode_groups=groups, prefills=())
    out = decode_attention(q, k_cache, v_cache, meta, 0.125)
    for group in groups:
        rows = slice(group.start, group.start + group.num_seqs)
        assert torch.equal(out[rows], paged_decode(q[rows], k_cache, v_cache, group.block_tables,
                                                   group.context_lens, 0.125))


def test_store_writes_strided_rows_of_the_fused_projection_like_torch(monkeypatch) -> None:
    qkv = torch.randn(5, 9 * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM)
    _, k, v = qkv.split([9 * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    k, v = k.view(5, KV_HEADS, HEAD_DIM), v.view(5, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([0, 17, 18, 511, 100])
    native = [torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(2)]
    assert native_cache(*native) and store_kv(k, v, *native, slots)
    monkeypatch.setenv(cpu_native.KERNEL_ENV, "torch")
    reference = [torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(2)]
    store_kvcache(k, v, *reference, slots)
    assert torch.equal(native[0], reference[0]) and torch.equal(native[1], reference[1])
    assert not native_cache(*reference)  # PDSERVE_CPU_KERNELS=torch


def test_layouts_the_kernels_do_not_read_go_to_torch() -> None:
    k_cache, _ = _caches(1)
    assert not native_cache(k_cache.half()) and not native_cache(k_cache.transpose(1, 2))
    k = torch.randn(2, HEAD_DIM, KV_HEADS).transpose(1, 2)  # heads not contiguous within a token
    assert not store_kv(k, k, k_cache, k_cache.clone(), torch.tensor([0, 1]))


def test_out_of_range_slots_and_blocks_raise_and_touch_nothing() -> None:
    k_cache, v_cache = _caches(2)
    before = k_cache.clone()
    k = torch.randn(2, KV_HEADS, HEAD_DIM)
    for slots in ([0, NUM_BLOCKS * BLOCK], [-1, 0]):
        with pytest.raises(IndexError, match="slot"):
            store_kv(k, k, k_cache, v_cache, torch.tensor(slots))
    assert torch.equal(k_cache, before)
    q = torch.randn(1, 9, HEAD_DIM)
    for table, length in (([[NUM_BLOCKS]], 3), ([[0]], BLOCK + 1), ([[-2]], 1)):
        with pytest.raises(IndexError, match="decode attention"):
            paged_decode(q, k_cache, v_cache, torch.tensor(table), torch.tensor([length]), 0.125)


def test_int32_tables_lengths_and_slots_are_read_as_int64() -> None:
    k_cache, v_cache = _caches(3)
    q = torch.randn(2, 9, HEAD_DIM)
    tables, lens = torch.tensor([[3, 4], [5, 0]]), torch.tensor([20, 7])
    wide = paged_decode(q, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(paged_decode(q, k_cache, v_cache, tables.int(), lens.int(), 0.125), wide)
    k = torch.randn(2, KV_HEADS, HEAD_DIM)
    caches = [torch.zeros_like(k_cache) for _ in range(4)]
    store_kv(k, k, caches[0], caches[1], torch.tensor([5, 40]))
    store_kv(k, k, caches[2], caches[3], torch.tensor([5, 40], dtype=torch.int32))
    assert torch.equal(caches[0], caches[2]) and caches[0].view(-1, KV_HEADS, HEAD_DIM)[40].equal(k[1])
