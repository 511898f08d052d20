"""`pdserve bench kernels`: the Triton paged decode kernel against device copy bandwidth and SDPA.

For each (batch, context): bf16, 32 query heads over 8 KV heads, head_dim 128, block 16, random
block tables. Reports the kernel's achieved K/V read bandwidth as a fraction of a device-to-device
copy measured in the same run (read + write bytes), and its time against
`F.scaled_dot_product_attention` over contiguous K/V gathered from the blocks, with the gather
timed and not. CUDA events around each call, L2 flushed before each, median of the iterations.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

BATCHES = (1, 32, 128)
CONTEXTS = (512, 4096, 16384)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64)


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def cuda_time_ms(
    fn: Callable[[], object], iters: int, warmup: int = 3, flush: torch.Tensor | None = None
) -> float:
    """Median over `iters` calls, each timed alone with CUDA events after an L2 flush."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gb_s(nbytes: int = 2 << 30, iters: int = 10) -> float:
    """Device-to-device copy: read + write bytes over the median time."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), iters)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _case(
    batch: int, context: int, iters: int, flush: torch.Tensor, copy_gb_s: float, gen: torch.Generator
) -> dict:
    from pdserve.kernels.paged_decode import choose_num_splits, paged_decode_attention

    blocks_per_seq = context // BLOCK_SIZE
    num_blocks = batch * blocks_per_seq
    # one layer of the engine's pool layout: [num_blocks, 1, 2, block_size, Hkv, D]
    shape = (num_blocks, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    pool = torch.randn(shape, device="cuda", dtype=DTYPE, generator=gen)
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    scale = HEAD_DIM**-0.5
    out = torch.empty_like(q)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = choose_num_splits(batch, context, NUM_KV_HEADS, num_sms=sms)

    def decode() -> None:
        paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, max_context_len=context, out=out)

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        # [B * W, bs, Hkv, D] -> [B, Hkv, S, D] contiguous
        flat = tables.flatten()
        shape = (batch, context, NUM_KV_HEADS, HEAD_DIM)
        k = k_cache.index_select(0, flat).view(shape).transpose(1, 2).contiguous()
        v = v_cache.index_select(0, flat).view(shape).transpose(1, 2).contiguous()
        return k, v

    k, v = gather()
    # the query heads of a KV group as the query rows of one head: [B, Hkv, group, D]; exact for a
    # single decode token, and keeps SDPA on its fused kernels without repeating K/V for GQA
    rows = q.view(batch, NUM_KV_HEADS, NUM_HEADS // NUM_KV_HEADS, HEAD_DIM)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(rows, k, v, scale=scale)

    def sdpa_with_gather() -> torch.Tensor:
        kg, vg = gather()
        return F.scaled_dot_product_attention(rows, kg, vg, scale=scale)

    decode()
    max_abs_diff = (out.float() - sdpa().reshape(out.shape).float()).abs().max().item()
    decode_ms = cuda_time_ms(decode, iters, flush=flush)
    sweep = {}  # the split heuristic against every split count, so that choose_num_splits can be checked
    for n in SPLIT_SWEEP:
        sweep[n] = round(cuda_time_ms(lambda n=n: paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, max_context_len=context, out=out, num_splits=n),
            iters, flush=flush), 4)
    best = min(sweep, key=sweep.get)
    sdpa_ms = cuda_time_ms(sdpa, iters, flush=flush)
    gather_ms = cuda_time_ms(sdpa_with_gather, iters, flush=flush)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * pool.element_size()
    achieved = kv_bytes / (decode_ms * 1e-3) / 1e9
    return {
        "batch": batch, "context": context, "num_splits": splits,
        "kv_mib": round(kv_bytes / (1 << 20), 1),
        "decode_ms": round(decode_ms, 4),
        "achieved_gb_s": round(achieved, 1),
        "fraction_of_copy": round(achieved / copy_gb_s, 3),
        "sdpa_ms": round(sdpa_ms, 4),
        "sdpa_with_gather_ms": round(gather_ms, 4),
        "speedup_vs_sdpa": round(sdpa_ms / decode_ms, 2),
        "speedup_vs_sdpa_with_gather": round(gather_ms / decode_ms, 2),
        "max_abs_diff_vs_sdpa": max_abs_diff,
        "splits_sweep_ms": sweep, "best_num_splits": best,
        "chosen_over_best": round(decode_ms / sweep[best], 2),
    }


def run(quick: bool = False, seed: int = 0) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("pdserve bench kernels needs a CUDA device (Triton kernels compile only there)")
    iters = 5 if quick else 20
    gen = torch.Generator(device="cuda").manual_seed(seed)
    copy_gb_s = copy_bandwidth_gb_s(iters=iters)
    _log(f"copy bandwidth {copy_gb_s:.0f} GB/s (read + write)")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    flush = torch.empty(max(4 * l2, 256 << 20), dtype=torch.uint8, device="cuda")
    cases = []
    for batch in BATCHES:
        for context in CONTEXTS:
            if quick and batch * context > 32 * 4096:
                continue
            cases.append(_case(batch, context, iters, flush, copy_gb_s, gen))
            _log(str(cases[-1]))
            torch.cuda.empty_cache()
    return {
        "device": torch.cuda.get_device_name(0),
        "dtype": "bfloat16", "num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM,
        "block_size": BLOCK_SIZE, "iters": iters,
        "copy_gb_s": round(copy_gb_s, 1),
        "cases": cases,
    }
