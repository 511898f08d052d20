"""`pdserve bench attention`: the engine's CPU decode attention against torch SDPA, and against the
bytes it must read.

Each case is a decode batch of `batch` sequences of `context` tokens over a paged pool whose blocks
are scattered (a random permutation of a pool 4x the batch's need, so the gather misses cache the way
a busy replica's does). `pdserve_ms` is `pdserve.models.attention.decode_attention`: the native kernel
(`pdserve.kernels.cpu_attention`, `engine_path` "native") where its library is built; else, per KV head,
bmm over the gathered K/V in place, for models with >= BMM_MIN_GROUP_SIZE query heads per KV head
("bmm"), else one SDPA call ("sdpa"). The peer `sdpa_ms` gathers the same blocks into the same buffer
and calls `F.scaled_dot_product_attention` on the padded batch with a length mask, as the engine did
before. Both run on the same inputs in the same process, interleaved. The physical reference is the
K/V bytes a step must read at least once, at the read bandwidth measured in the same run.
"""

from __future__ import annotations

import json
import random
import time

import torch
import torch.nn.functional as F

from pdserve.bench.roofline import read_bandwidth_gb_s
from pdserve.kernels.cpu_attention import native_cache
from pdserve.models.attention import BMM_MIN_GROUP_SIZE, AttentionMetadata, DecodeGroup, decode_attention
from pdserve.models.resolve import resolve_model_path, served_model_name

CASES = ((1, 512), (1, 1500), (2, 1500), (4, 1500), (8, 1500), (16, 512), (32, 256))
BLOCK_SIZE = 16


def sdpa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup,
                buffers: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    """The peer: one padded SDPA call over the batch, a boolean length mask when it has 2+ rows."""
    n, width = group.block_tables.shape
    blocks = group.block_tables.flatten()
    span = group.max_context_len
    k = torch.index_select(k_cache, 0, blocks, out=buffers[0][: blocks.numel()]).view(n, width * BLOCK_SIZE,
                                                                                     *k_cache.shape[2:])
    v = torch.index_select(v_cache, 0, blocks, out=buffers[1][: blocks.numel()]).view(n, width * BLOCK_SIZE,
                                                                                     *v_cache.shape[2:])
    k, v = k[:, :span].transpose(1, 2), v[:, :span].transpose(1, 2)
    mask = None
    if n > 1:
        mask = (torch.arange(span)[None, :] < group.context_lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=True).squeeze(2)


def _shape(model: str) -> tuple[int, int, int]:
    config = json.loads((resolve_model_path(model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    return heads, kv_heads, config.get("head_dim") or config["hidden_size"] // heads


def _case(batch: int, context: int, shape: tuple[int, int, int], repeats: int, rng: random.Random) -> dict:
    heads, kv_heads, head_dim = shape
    width = -(-context // BLOCK_SIZE)
    num_blocks = 4 * batch * width
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.tensor(ids[: batch * width], dtype=torch.int64).view(batch, width)
    # lengths differ by up to a block, as running sequences' do
    lens = torch.tensor([context - rng.randrange(BLOCK_SIZE) if i else context for i in range(batch)])
    group = DecodeGroup(0, tables, lens, context)
    buffers = tuple(torch.empty(batch * width, BLOCK_SIZE, kv_heads, head_dim) for _ in range(2))
    meta = AttentionMetadata(torch.zeros(batch, dtype=torch.int64), batch, (group,), (), workspace=buffers)
    q = torch.randn(batch, heads, head_dim)
    scale = head_dim**-0.5
    ours = lambda: decode_attention(q, k_cache, v_cache, meta, scale)  # noqa: E731
    peer = lambda: sdpa_decode(q, k_cache, v_cache, group, buffers, scale)  # noqa: E731
    max_err = (ours() - peer()).abs().max().item()
    times: dict[str, list[float]] = {"pdserve": [], "sdpa": []}
    for _ in range(repeats):  # interleaved, so both see the same drift
        for name, fn in (("pdserve", ours), ("sdpa", peer)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    pdserve_s, sdpa_s = (sorted(times[n])[len(times[n]) // 2] for n in ("pdserve", "sdpa"))
    kv_bytes = int(lens.sum()) * kv_heads * head_dim * 2 * 4
    return {"batch": batch, "context": context, "kv_bytes": kv_bytes, "pdserve_ms": round(pdserve_s * 1e3, 4),
            "sdpa_ms": round(sdpa_s * 1e3, 4), "speedup_vs_sdpa": round(sdpa_s / pdserve_s, 3),
            "pdserve_gb_s": round(kv_bytes / pdserve_s / 1e9, 2), "max_abs_diff": max_err}


def _engine_path(shape: tuple[int, int, int]) -> str:
    """The path decode_attention takes for this shape's float32 cache (as `_case` builds it)."""
    cache = torch.empty(1, BLOCK_SIZE, shape[1], shape[2])
    if native_cache(cache, cache):
        return "native"
    return "bmm" if shape[0] // shape[1] >= BMM_MIN_GROUP_SIZE else "sdpa"


def run(model: str | None = None, quick: bool = False, seed: int = 0, threads: int = 1) -> dict:
    model = model or "smollm2-135m-instruct"
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    shape = _shape(model)
    rng = random.Random(seed)
    with torch.inference_mode():
        cases = [_case(b, c, shape, 20 if quick else 100, rng) for b, c in CASES]
    read_bw = read_bandwidth_gb_s()
    for case in cases:
        case["roofline_fraction"] = round(case["pdserve_gb_s"] / read_bw, 3)
    return {
        "bench": "attention", "model": served_model_name(model), "threads": threads,
        "heads": shape[0], "kv_heads": shape[1], "head_dim": shape[2], "block_size": BLOCK_SIZE,
        "engine_path": _engine_path(shape),
        "read_bw_gb_s": round(read_bw, 2), "cases": cases,
        "min_speedup_vs_sdpa": min(c["speedup_vs_sdpa"] for c in cases),
        "speedup_vs_sdpa_batched": round(min(c["speedup_vs_sdpa"] for c in cases if c["batch"] > 1), 3),
    }
