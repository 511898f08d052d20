"""The native decode attention and KV store over the paged float32 and float16 caches
(pdserve.kernels.cpu_attention) against torch's path in pdserve.models.attention, on the same caches."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_attention import native_cache, paged_decode, store_kv
from pdserve.models.attention import AttentionMetadata, DecodeGroup, decode_attention, store_kvcache

if cpu_native.library() is None:
    pytest.skip(f"native kernels not built: {cpu_native.unavailable_reason()}", allow_module_level=True)

NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM = 32, 16, 3, 64


def _caches(seed: int, layout: str = "pool", dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """"pool": layer 1's K and V views of a 3-layer pool [blocks, layers, 2, block, Hkv, D], as the engine
    allocates them (pdserve.kvcache.quant.allocate_kv_cache): blocks strided. "contiguous": two tensors."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "pool":
        pool = torch.randn(NUM_BLOCKS, 3, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        return pool[:, 1, 0], pool[:, 1, 1]
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)

HALF = bool(cpu_native.library().pd_kv_half_supported())  # built with F16C


def test_the_engines_caches_take_the_native_path() -> None:
    from pdserve.engine.llm import LLM

    caches = LLM(model="tiny", device="cpu").engine.runner.kv_caches
    assert all(native_cache(k, v) for k, v in caches)
    assert not caches[0][0].is_contiguous()  # the strided case is the one served


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["pool", "contiguous"])
@pytest.mark.parametrize("heads", [3, 9, 12])  # MHA, GQA 3, GQA 4 (torch's bmm path)
@pytest.mark.parametrize("lens", [[1], [16], [37, 100, 5], [200, 200]])
def test_decode_attention_matches_torchs_path(monkeypatch, heads: int, lens: list[int], layout: str,
                                              dtype: torch.dtype) -> None:
    k_cache, v_cache = _caches(len(lens) + heads, layout, dtype)
    assert native_cache(k_cache, v_cache) == (dtype is torch.float32 or HALF)
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


@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("lens", [[300], [5, 130], [33, 32, 64], [1, 500]])
def test_contexts_split_across_threads_merge_to_torchs_result(monkeypatch, lens: list[int], threads: int) -> None:
    """A small batch's long contexts are cut into pieces, as many as the threads call for, and their partial
    softmaxes merged: any thread count, and sequences cut into different numbers of pieces, give torch's
    result."""
    k_cache, v_cache = _caches(threads, "pool", torch.float32)
    gen = torch.Generator().manual_seed(sum(lens))
    width = max((n + BLOCK - 1) // BLOCK for n in lens)
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=gen)[:width] for _ in lens])
    q = torch.randn(len(lens), 9, HEAD_DIM, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        native = paged_decode(q, k_cache, v_cache, tables, torch.tensor(lens), HEAD_DIM**-0.5)
    finally:
        torch.set_num_threads(before)
    group = DecodeGroup(0, tables, torch.tensor(lens), max(lens))
    meta = AttentionMetadata(slot_mapping=torch.arange(len(lens)), num_decode_tokens=len(lens),
                             decode_groups=(group,), prefills=())
    monkeypatch.setenv(cpu_native.KERNEL_ENV, "torch")
    reference = decode_attention(q, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    assert (native - reference).abs().max() < 1e-5


def _assert_plain_softmax_attention(head_dim: int, group: int, dtype: torch.dtype, seed: int) -> None:
    """paged_decode against softmax attention written out over the gathered rows: 2 KV heads, `group` query
    heads on each."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache = (torch.randn(8, BLOCK, 2, head_dim, generator=gen).to(dtype) for _ in range(2))
    lens, tables = [70, 3], torch.tensor([[5, 1, 7, 2, 0], [6, 0, 0, 0, 0]])
    q = torch.randn(2, 2 * group, head_dim, generator=gen)
    out = paged_decode(q, k_cache, v_cache, tables, torch.tensor(lens), head_dim**-0.5)
    for i, n in enumerate(lens):
        k = k_cache[tables[i]].reshape(-1, 2, head_dim)[:n].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_cache[tables[i]].reshape(-1, 2, head_dim)[:n].float().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,shd->hs", q[i], k) * head_dim**-0.5, dim=-1)
        assert (out[i] - torch.einsum("hs,shd->hd", weights, v)).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [40, 32, 128])  # the plain loops (not a multiple of 16), and registers
def test_head_sizes_match_plain_softmax_attention(head_dim: int, dtype: torch.dtype) -> None:
    if dtype is torch.float16 and not HALF:
        pytest.skip("built without F16C")
    _assert_plain_softmax_attention(head_dim, 3, dtype, head_dim)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])  # query heads per KV head: one pass, and several
@pytest.mark.parametrize("head_dim", [16, 64, 128])  # 4 heads a pass up to 64, 2 at 128
def test_query_heads_per_kv_head_match_plain_softmax_attention(group: int, head_dim: int) -> None:
    """The register kernel reads each K and V row once for the heads of a pass; every split of a KV head's
    query heads into passes gives each head its own softmax."""
    _assert_plain_softmax_attention(head_dim, group, torch.float32, 100 * group + head_dim)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_writes_strided_rows_of_the_fused_projection_like_torch(monkeypatch, dtype: torch.dtype) -> None:
    if dtype is torch.float16 and not HALF:
        pytest.skip("built without F16C: float16 caches take torch's path")
    qkv = torch.randn(5, 9 * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM)
    _, k, v = qkv.split([9 * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    k, v = k.view(5, KV_HEADS, HEAD_DIM), v.view(5, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([0, 17, 18, 511, 100])
    pools = [torch.zeros(NUM_BLOCKS, 3, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype) for _ in range(2)]
    native = [pools[0][:, 1, 0], pools[0][:, 1, 1]]
    assert native_cache(*native) and store_kv(k, v, *native, slots)
    monkeypatch.setenv(cpu_native.KERNEL_ENV, "torch")
    reference = [pools[1][:, 1, 0], pools[1][:, 1, 1]]
    store_kvcache(k, v, *reference, slots)
    assert torch.equal(pools[0], pools[1])  # the other layers' slots untouched alike; float16 rounded alike
    assert not native_cache(*reference)  # PDSERVE_CPU_KERNELS=torch


def test_layouts_the_kernels_do_not_read_go_to_torch() -> None:
    k_cache, _ = _caches(1)
    k16, v16 = _caches(1, dtype=torch.float16)
    kb, vb = _caches(1, dtype=torch.bfloat16)
    assert not native_cache(kb, vb)
    assert not native_cache(k16, _caches(1)[1])  # K and V in different dtypes
    assert not native_cache(k_cache, k_cache.transpose(1, 2))
    assert not native_cache(k_cache, _caches(1, "contiguous")[1])  # K and V with different block strides
    k = torch.randn(2, HEAD_DIM, KV_HEADS).transpose(1, 2)  # heads not contiguous within a token
    assert not store_kv(k, k, k_cache, k_cache.clone(), torch.tensor([0, 1]))


def test_out_of_range_slots_and_blocks_raise_and_touch_nothing() -> None:
    k_cache, v_cache = _caches(2)
    before = k_cache._base.clone()
    k = torch.randn(2, KV_HEADS, HEAD_DIM)
    for slots in ([0, NUM_BLOCKS * BLOCK], [-1, 0]):
        with pytest.raises(IndexError, match="slot"):
            store_kv(k, k, k_cache, v_cache, torch.tensor(slots))
    assert torch.equal(k_cache._base, before)
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
