"""`pdserve bench kvquant`: what int8 (and fp8 e4m3) KV caches cost in accuracy and save in bytes.

Real weights (SmolLM2-135M-Instruct by default), one run:
- sizes from the layouts: pool bytes per token (scales included) and blocks per GiB per KV dtype;
- a real handoff of the same prompt over a transport (UCX on loopback), bytes received int8 / bf16;
- perplexity of a fixed English text (kvquant_text.txt, > 2,000 tokens), teacher-forced through the paged
  path in chunks of 256 (every chunk reads the keys back from the quantized cache), int8 / fp8 vs auto;
- greedy continuations (64 prompts x 64 tokens), int8 vs auto: identical share, first divergences;
- the scale layout's error on the model's real K/V: per (token, KV head) vs per (block, layer, KV head);
- decode tokens/s at batch 32 with 1,024-token contexts over a synthetically filled pool (no prefill),
  auto and int8 steps interleaved.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from pathlib import Path

import torch

from pdserve.bench.kvquant_decode import decode_tokens_per_s
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLM, AsyncLLMEngine, GenerationRequest, LLMEngine
from pdserve.kernels.kv_quant import dequantize, quantize
from pdserve.engine.handoff import KVExporter, KVImporter, engine_layout, engine_pool
from pdserve.kvcache.layout import layout_of
from pdserve.models.config import load_model_config
from pdserve.models.resolve import resolve_model_path
from pdserve.sampling_params import SamplingParams

TEXT = Path(__file__).with_name("kvquant_text.txt")
GIB = 1 << 30
CHUNK = 256
PROMPT_TOKENS = 32


def _log(message: str) -> None:
    print(f"[bench kvquant] {message}", file=sys.stderr, flush=True)


def _engine_config(model: str, kv_cache_dtype: str, num_blocks: int, dtype: str = "float32") -> EngineConfig:
    return EngineConfig(
        model=model, device="cpu", dtype=dtype,
        cache=CacheConfig(num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=CHUNK),
    )


def sizes(model_dir: Path, block_size: int = 16) -> dict:
    config = load_model_config(model_dir)
    layouts = {
        "auto": layout_of(config, torch.float32, block_size),
        "bfloat16": layout_of(config, torch.bfloat16, block_size),
        "int8": layout_of(config, torch.float32, block_size, "int8"),
        "fp8_e4m3": layout_of(config, torch.float32, block_size, "fp8_e4m3"),
    }
    return {
        "kv_bytes_per_token": {k: v.bytes_per_token for k, v in layouts.items()},
        "kv_bytes_ratio_int8": round(layouts["int8"].bytes_per_token / layouts["bfloat16"].bytes_per_token, 4),
        "blocks_per_gib": {k: GIB // v.block_nbytes for k, v in layouts.items()},
    }


def perplexity(llm: LLM, token_ids: list[int]) -> float:
    (out,) = llm.generate([token_ids], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    logprobs = [lp for lp in out.prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def greedy_prompts(token_ids: list[int], num_prompts: int) -> list[list[int]]:
    stride = (len(token_ids) - PROMPT_TOKENS) // num_prompts
    return [token_ids[i * stride : i * stride + PROMPT_TOKENS] for i in range(num_prompts)]


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """Per prompt: the greedy tokens and, per token, the logprob gap between the top two candidates."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params)
    return [(out.token_ids, [top[0][1] - top[1][1] for top in out.top_logprobs]) for out in outs]


def compare_greedy(reference: list[tuple], candidate: list[tuple], max_tokens: int) -> dict:
    divergences, gaps = [], []
    for (ref, ref_gaps), (cand, _) in zip(reference, candidate):
        first = next((i for i, (a, b) in enumerate(zip(ref, cand)) if a != b), None)
        if first is not None:
            divergences.append(first)
            gaps.append(ref_gaps[first])
    all_gaps = sorted(g for _, ref_gaps in reference for g in ref_gaps)
    buckets = {f"{lo}-{lo + 15}": sum(lo <= d < lo + 16 for d in divergences) for lo in range(0, max_tokens, 16)}
    return {
        "share_identical": round(1 - len(divergences) / len(reference), 4),
        "num_prompts": len(reference), "num_tokens": max_tokens,
        "first_divergence_positions": sorted(divergences),
        "first_divergence_histogram": buckets,
        # the unquantized run's top-1 minus top-2 logprob where int8 first picks another token, next to
        # the median over every generated token: divergences happen at near-ties
        "top2_gap_at_divergence_median": round(sorted(gaps)[len(gaps) // 2], 4) if gaps else None,
        "top2_gap_at_divergence_max": round(max(gaps), 4) if gaps else None,
        "top2_gap_all_tokens_median": round(all_gaps[len(all_gaps) // 2], 4),
    }


def scale_layout_error(engine: LLMEngine) -> dict:
    """Relative int8 error of the real K/V left in an unquantized pool, under both candidate scale layouts."""
    pool = engine.runner.kv_pool  # [num_blocks, L, 2, bs, Hkv, D]
    used = pool.flatten(1).abs().amax(1) > 0
    kv = pool[used].float()
    q, s = quantize(kv, "int8")
    per_token = dequantize(q, s)
    # per (block, layer, K/V, head): one amax over the block's tokens and head_dim
    blocks = kv.permute(0, 1, 2, 4, 3, 5).flatten(-2)  # [n, L, 2, Hkv, bs * D]
    qb, sb = quantize(blocks, "int8")
    per_block = dequantize(qb, sb).unflatten(-1, kv.shape[3:4] + kv.shape[5:]).permute(0, 1, 2, 4, 3, 5)
    norm = kv.norm()
    return {
        "token_head": round(float((per_token - kv).norm() / norm), 5),
        "block_head": round(float((per_block - kv).norm() / norm), 5),
        "num_blocks": int(used.sum()),
    }


async def _handoff_bytes(model: str, kv_cache_dtype: str, prompt: list[int], transport: str) -> int:
    engine = AsyncLLMEngine(LLMEngine(_engine_config(model, kv_cache_dtype, 128, dtype="bfloat16")))
    pool, layout = engine_pool(engine), engine_layout(engine)
    if transport == "ucx":
        from pdserve.kvcache.transports.ucx import UCXTransport

        source = UCXTransport(pool, layout, engine.release_lease_quietly)
        sink = UCXTransport(pool, layout)
    else:
        from pdserve.kvcache.transports.local import LocalHub, LocalTransport

        hub = LocalHub()
        source = LocalTransport(pool, layout, engine.release_lease_quietly, hub=hub)
        sink = LocalTransport(pool, layout, hub=hub)
    await source.start()
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        request = GenerationRequest("p", tuple(prompt), params, prefill_only=True)
        (delta,) = [d async for d in engine.generate(request)]
        params = await KVExporter(engine, source).export(delta.kv_handoff)
        result = await KVImporter(engine, sink).import_kv(params)  # into other blocks of the same pool
        if not result.ok:
            raise RuntimeError(f"handoff fell back: {result.fallback_reason}: {result.error}")
        await engine.release_lease(result.lease_id)
        return sink.bytes_pulled
    finally:
        await sink.close()
        await source.close()
        await engine.close()


def handoff(model: str, prompt: list[int]) -> dict:
    from pdserve.kvcache.transports.ucx_env import UCXConfig, apply_ucx_env

    apply_ucx_env(UCXConfig())  # before libucx loads: its warnings would go to stdout, ahead of the JSON
    try:
        import ucxx  # noqa: F401

        transport = "ucx"
    except ImportError:
        transport = "local"
    moved = {kv: asyncio.run(_handoff_bytes(model, kv, prompt, transport)) for kv in ("auto", "int8")}
    return {
        "transport": transport, "prompt_tokens": len(prompt), "model_dtype": "bfloat16",
        "bytes": {"bfloat16": moved["auto"], "int8": moved["int8"]},
        "ratio_int8": round(moved["int8"] / moved["auto"], 4),
    }


def run(model: str | None = None, quick: bool = False, seed: int = 0) -> dict:
    model = model or "smollm2-135m-instruct"
    model_dir = resolve_model_path(model)
    start = time.perf_counter()
    result: dict = {"model": model, **sizes(model_dir)}
    num_prompts, max_tokens = (16, 16) if quick else (64, 64)
    text_ids: list[int] = []
    ppl, outputs = {}, {}
    for kv in ("auto", "float16", "int8", "fp8_e4m3"):
        _log(f"{kv}: perplexity and greedy continuations")
        llm = LLM(_engine_config(str(model_dir), kv, num_blocks=512))
        text_ids = text_ids or llm.tokenizer.encode(TEXT.read_text())
        ppl[kv] = perplexity(llm, text_ids[: 512 if quick else None])
        if kv == "auto":
            result["scale_layout_rel_error_int8"] = scale_layout_error(llm.engine)
        if kv in ("auto", "float16", "int8"):
            outputs[kv] = greedy(llm, greedy_prompts(text_ids, num_prompts), max_tokens)
        del llm
    result["text_tokens"] = len(text_ids) if not quick else 512
    result["perplexity"] = {k: round(v, 4) for k, v in ppl.items()}
    result["ppl_delta_pct_int8"] = round(100 * (ppl["int8"] / ppl["auto"] - 1), 4)
    result["ppl_delta_pct_fp8_e4m3"] = round(100 * (ppl["fp8_e4m3"] / ppl["auto"] - 1), 4)
    result["ppl_delta_pct_float16"] = round(100 * (ppl["float16"] / ppl["auto"] - 1), 4)
    result["greedy_match_float16"] = compare_greedy(outputs["auto"], outputs["float16"], max_tokens)["share_identical"]
    match = compare_greedy(outputs["auto"], outputs["int8"], max_tokens)
    result["greedy_match_int8"] = match["share_identical"]
    result["greedy_int8"] = match
    _log("handoff bytes over the transport")
    result["handoff"] = handoff(str(model_dir), text_ids[:512])
    result["handoff_bytes_ratio_int8"] = result["handoff"]["ratio_int8"]
    _log("decode tokens/s, batch 32 x 1,024-token contexts (synthetic KV)")
    decode = decode_tokens_per_s(str(model_dir), ("auto", "float16", "int8"), steps=2 if quick else 7, seed=seed)
    result["decode_tok_s_b32_ctx1024"] = decode
    result["decode_speedup_int8"] = round(decode["int8"]["tok_s"] / decode["auto"]["tok_s"], 3)
    result["decode_speedup_float16"] = round(decode["float16"]["tok_s"] / decode["auto"]["tok_s"], 3)
    result["machine"] = {"device": "cpu", "torch_threads": torch.get_num_threads(), "attention_backend": "torch"}
    result["seconds"] = round(time.perf_counter() - start, 1)
    return result
