import itertools
import random

import pytest
import torch

from pdserve.kernels.paged_decode import choose_num_splits, paged_decode_attention, paged_decode_attention_ref
from pdserve.kernels.testing import PagedInputs, assert_close, paged_inputs
from pdserve.models.attention import AttentionMetadata, DecodeGroup, decode_attention

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# every dtype x GQA ratio twice; head_dim and block_size cycle through all four pairs
CASES = [
    (i, dtype, group, (64, 128)[i % 2], (16, 32)[i // 2 % 2])
    for i, (_, dtype, group) in enumerate(itertools.product(range(2), DTYPES, [1, 4, 8]))
]


def _decode_inputs(seed, dtype, group, head_dim, block_size, **kw):
    rng = random.Random(seed)
    batch = rng.choice([1, 2, 3, 5])
    lens = [rng.randint(1, 300) for _ in range(batch)]
    lens[0] = (1, block_size, block_size + 1, 3 * block_size - 5)[seed % 4]  # 1, exact, and off-block
    return paged_inputs(
        [1] * batch, lens, num_kv_heads=rng.choice([1, 2]), group=group, head_dim=head_dim,
        block_size=block_size, dtype=dtype, seed=seed, decode=True,
        table_dtype=(torch.int64, torch.int32)[seed % 2], **kw,
    )


def _decode(x: PagedInputs, **kw) -> torch.Tensor:
    return paged_decode_attention(x.q, x.k_cache, x.v_cache, x.block_tables, x.context_lens, x.scale, **kw)


def _reference(x: PagedInputs) -> torch.Tensor:
    return paged_decode_attention_ref(x.q, x.k_cache, x.v_cache, x.block_tables, x.context_lens, x.scale)


@pytest.mark.parametrize("seed,dtype,group,head_dim,block_size", CASES)
def test_decode_matches_reference(seed, dtype, group, head_dim, block_size):
    x = _decode_inputs(seed, dtype, group, head_dim, block_size)
    num_splits = (None, 1, 2, 3, 5)[seed % 5]
    out = _decode(x, num_splits=num_splits)
    expected = _reference(x)
    assert out.dtype == dtype and out.shape == x.q.shape
    assert_close(out, expected, dtype)


def test_more_splits_than_keys_leaves_empty_splits_out():
    x = paged_inputs([1, 1], [1, 70], num_kv_heads=2, group=4, head_dim=64, block_size=16,
                     dtype=torch.float32, decode=True)
    assert_close(_decode(x, num_splits=8), _reference(x), torch.float32)


def test_split_counts_agree_with_each_other():
    x = paged_inputs([1], [200], num_kv_heads=1, group=8, head_dim=64, block_size=16, dtype=torch.float32,
                     decode=True)
    torch.testing.assert_close(_decode(x, num_splits=1), _decode(x, num_splits=4), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,group", [(torch.float32, 4), (torch.bfloat16, 8), (torch.float16, 1)])
def test_decode_agrees_with_engine_torch_path(dtype, group):
    # sorted lengths in two padded groups, as ModelRunner builds them; the kernel takes the whole batch
    lens = [1, 5, 17, 33, 40, 64]
    x = paged_inputs([1] * len(lens), lens, num_kv_heads=2, group=group, head_dim=64, block_size=16,
                     dtype=dtype, decode=True, seed=group)
    groups = []
    for start, end in ((0, 3), (3, 6)):
        width = -(-max(lens[start:end]) // 16)
        tables = x.block_tables[start:end, :width].clone()
        for row, n in enumerate(lens[start:end]):
            tables[row, -(-n // 16):] = 0
        groups.append(DecodeGroup(start, tables, x.context_lens[start:end], max(lens[start:end])))
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), len(lens), tuple(groups), ())
    engine = decode_attention(x.q, x.k_cache, x.v_cache, meta, x.scale)
    assert_close(_decode(x, num_splits=2), engine, dtype)


@pytest.mark.parametrize("seed,dtype,group,head_dim,block_size", CASES)
def test_engine_torch_path_matches_reference(seed, dtype, group, head_dim, block_size):
    # one padded group over the whole batch, gathered into a reused workspace as ModelRunner does
    x = _decode_inputs(seed, dtype, group, head_dim, block_size)
    lens = x.context_lens.tolist()
    width = -(-max(lens) // block_size)
    tables = x.block_tables[:, :width].to(torch.int64)
    workspace = tuple(torch.full((tables.numel() + 3, *x.k_cache.shape[1:]), float("nan"), dtype=dtype)
                      for _ in range(2))
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), len(lens),
                             (DecodeGroup(0, tables, x.context_lens.to(torch.int64), max(lens)),), (),
                             workspace=workspace)
    out = decode_attention(x.q, x.k_cache, x.v_cache, meta, x.scale)
    assert out.dtype == dtype and out.shape == x.q.shape
    assert_close(out, _reference(x), dtype)


@pytest.mark.parametrize(
    "batch,context,kv_heads,num_sms,expected",
    [
        (1, 16384, 8, 132, 32),  # capped at max_splits
        (1, 512, 8, 132, 2),  # bounded by min tokens per split
        (1, 100, 8, 132, 1),  # too short to split
        (4, 4096, 8, 132, 9),  # ceil(264 / 32) programs short of two per SM
        (32, 4096, 8, 132, 2),
        (128, 16384, 8, 132, 1),  # the batch alone fills the GPU
        (2, 8192, 8, 16, 2),
    ],
)
def test_choose_num_splits(batch, context, kv_heads, num_sms, expected):
    assert choose_num_splits(batch, context, kv_heads, num_sms=num_sms) == expected


@pytest.mark.parametrize("head_dim,block_size", [(80, 16), (32, 8)])
def test_other_head_dims_and_block_sizes(head_dim, block_size):
    x = paged_inputs([1, 1], [45, 130], num_kv_heads=2, group=2, head_dim=head_dim, block_size=block_size,
                     dtype=torch.float32, decode=True, seed=head_dim)
    assert_close(_decode(x, num_splits=3), _reference(x), torch.float32)


def test_bench_attention_prints_both_paths_as_json():
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("pdserve")
    out = subprocess.run([str(script), "bench", "attention", "--quick", "--model", "tiny", "--json"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    result = json.loads(out)
    assert result["bench"] == "attention" and result["read_bw_gb_s"] > 0
    from pdserve.kernels.cpu_attention import library
    assert result["engine_path"] == ("native" if library() is not None else "sdpa")  # tiny: 2 query heads a KV head
    assert [(c["batch"], c["context"]) for c in result["cases"]][:2] == [(1, 512), (1, 1500)]
    for case in result["cases"]:
        assert case["pdserve_ms"] > 0 and case["sdpa_ms"] > 0 and case["kv_bytes"] > 0
        assert case["max_abs_diff"] < 1e-4  # both paths attend over the same blocks
