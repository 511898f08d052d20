"""`pdserve bench engine`: pdserve against HF transformers `generate`, fp32, CPU.

The default model is a ~125M random Llama; `--model` takes any name `resolve_model_path` knows. A GGUF
model is dequantized once into an HF directory, and both engines load that same directory. `--quantization`
serves pdserve's linears quantized (HF stays fp32); the roofline fractions count the bytes the served weights
and the KV cache actually read per decode step.

The b1 run is one request (256 prompt tokens, 128 output tokens). `pdserve_tok_s_b1` is its 128 tokens over
the whole run, the prefill included; the same prompt with one output token, timed alone, is the prefill, and
the rest of the run is its 127 decode steps (`pdserve_decode_tok_s_b1`); `decode_split_b1` says where one of
them goes (pdserve.bench.engine_split). `roofline_fraction_b1` is the decode steps' rate times the bytes a
step reads, over the read bandwidth: how close a memory-bound step comes to the bandwidth. It is the median
of paired rounds, each one request's decode rate against the bandwidth read just before and after it
(pdserve.bench.engine_paired: this VM's bandwidth moves within seconds). `roofline_fraction_b1_run_max_bw`
divides the b1 run's rate by the higher of two readings taken before all the runs and after them, minutes
apart; `roofline_fraction_b1_end_to_end` counts the whole run against those readings, the compute-bound
prefill included.

For a GGUF model, llama.cpp decodes the same b1 request from the same file in the same run, when `pdserve
bench peer`'s scratch venv is there (pdserve.bench.engine_peer): `llama_cpp_roofline_fraction_b1` is its
fraction of the run's higher reading (compare it with `roofline_fraction_b1_run_max_bw`),
`ratio_decode_b1_llama_cpp` pdserve's decode rate over its.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from pdserve.bench.engine_paired import bandwidth_probe, paired_fractions, paired_roofline
from pdserve.bench.engine_peer import gguf_step_weight_bytes, kv_bytes_per_token, llama_cpp_decode_b1
from pdserve.bench.engine_split import decode_step_split
from pdserve.bench.roofline import gemv_bandwidth_gb_s, read_bandwidth_gb_s
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLM
from pdserve.engine.model_runner import kv_block_bytes
from pdserve.models.served import decode_read_bytes
from pdserve.models.resolve import MODEL_ALIASES, alias_gguf_path, resolve_model_path, served_model_name
from pdserve.models.tiny import default_cache_dir, ensure_tiny_checkpoint
from pdserve.sampling_params import SamplingParams

PAIRED_ROUNDS = 7  # b1 requests read against the bandwidth around each, pdserve's and llama.cpp's alike
BENCH_MODEL = dict(
    vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
    num_key_value_heads=4, intermediate_size=2048, max_position_embeddings=2048,
)


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def build_bench_model(root: Path | None = None) -> Path:
    import transformers

    path = (root or default_cache_dir()) / "bench-llama-125m-v1"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BENCH_MODEL))
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tiny = ensure_tiny_checkpoint()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, tmp / name)
    os.replace(tmp, path)
    return path


def mixed_workload(seed: int, num_requests: int = 64, vocab_size: int = 32000) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    top = min(vocab_size, 32000)
    return [
        ([rng.randrange(10, top) for _ in range(rng.randint(32, 512))], rng.randint(16, 256))
        for _ in range(num_requests)
    ]


def streamed_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters read in one decode step (the embedding table is indexed, not streamed)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)


def decode_step_read_bytes(llm: LLM, context_tokens: float) -> dict[str, int]:
    """Bytes one batch-1 decode step reads at a context of `context_tokens`: the served weights (quantized
    codes and kernel scales, or float weights; pdserve.models.served) and every context token's K/V."""
    engine = llm.engine
    block_size = engine.block_manager.block_size
    kv_per_token = kv_block_bytes(engine.model_config, block_size, engine.config.torch_dtype,
                                  engine.config.cache.kv_cache_dtype) // block_size
    return {"weights": decode_read_bytes(engine.runner.model), "kv": round(kv_per_token * context_tokens)}


def _pdserve_run(llm: LLM, workload: list[tuple[list[int], int]]) -> float:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in workload]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in workload], params)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outputs] == [n for _, n in workload]
    return elapsed


@torch.inference_mode()
def _hf_run(model, workload: list[tuple[list[int], int]], batch_size: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        batch = workload[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):  # left padding
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        num_new = max(n for _, n in batch)
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=num_new, min_new_tokens=num_new,
            do_sample=False, pad_token_id=0,
        )
    return time.perf_counter() - start


def _gguf_of(model: str | None) -> Path | None:
    if model in MODEL_ALIASES:
        return alias_gguf_path(model)
    if model is not None and model.endswith(".gguf") and Path(model).expanduser().is_file():
        return Path(model).expanduser()
    return None


def _llama_cpp_b1(model: str | None, config: dict, prompt: list[int], max_tokens: int, threads: int,
                  mode: str, probe: Callable[[], float]) -> dict:
    """llama.cpp's b1 decode on the model's GGUF file, or why it did not run."""
    from pdserve.bench.peer import DEFAULT_VENV, XLLAMACPP

    gguf = _gguf_of(model)
    if mode == "off":
        return {"skipped": "--llama-cpp off"}
    if gguf is None:
        return {"skipped": "the model is not a GGUF file"}
    if not (DEFAULT_VENV / "bin" / "python").exists():
        return {"skipped": f"no peer venv at {DEFAULT_VENV} (`pdserve bench peer` makes it)"}
    result = llama_cpp_decode_b1(gguf, DEFAULT_VENV, XLLAMACPP, prompt, max_tokens, threads, PAIRED_ROUNDS, probe)
    weights = gguf_step_weight_bytes(gguf)
    kv = round(kv_bytes_per_token(config) * (len(prompt) + max_tokens / 2))  # at the b1 run's mean context
    runs = [{"decode_tok_s": tok_s, "bw_gb_s": bw}
            for tok_s, bw in zip(result["decode_tok_s_runs"], result["bw_gb_s_runs"])]
    paired = paired_fractions(runs, weights + kv)
    return {**result, "step_bytes_b1": weights + kv, "weight_bytes": weights, "kv_read_bytes_b1": kv,
            "roofline_fraction_b1": paired["median"], "roofline_fraction_b1_paired": paired}


def run(quick: bool = False, seed: int = 0, model: str | None = None, pack_weights: bool = True,
        quantization: str = "none", llama_cpp: str = "auto") -> dict:
    import transformers

    path = build_bench_model() if model is None else resolve_model_path(model)
    label = "llama-125m-random" if model is None else served_model_name(model)
    threads = torch.get_num_threads()
    _log(f"model {label} at {path}, {threads} threads; HF loads the same directory")
    b1 = [(list(range(1000, 1256)), 128)]
    config = json.loads((path / "config.json").read_text())
    vocab_size = config["vocab_size"]
    mixed = mixed_workload(seed, 16 if quick else 64, vocab_size)
    llm = LLM(EngineConfig(
        model=str(path), device="cpu", dtype="float32",
        cache=CacheConfig(block_size=16, memory_budget_bytes=2 << 30, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048), pack_weights=pack_weights,
        quantization=quantization,
    ))
    _log(llm.engine.served_weights)
    # b1: 256 prompt tokens, then decode steps at contexts 257 .. 383 (mean 320)
    read = decode_step_read_bytes(llm, len(b1[0][0]) + b1[0][1] / 2)
    weight_bytes, step_bytes = read["weights"], read["weights"] + read["kv"]
    probe = bandwidth_probe()
    bw_before = read_bandwidth_gb_s()  # and again after the runs: the best the machine read in this run
    _pdserve_run(llm, [(b1[0][0], 8)])  # warm-up
    pd_b1 = min(_pdserve_run(llm, b1) for _ in range(2))
    pd_b1_prefill = min(_pdserve_run(llm, [(b1[0][0], 1)]) for _ in range(2))  # no prefix caching: recomputed
    pd_b1_decode_tok_s = (b1[0][1] - 1) / max(pd_b1 - pd_b1_prefill, 1e-9)
    _log(f"pdserve b1 {128 / pd_b1:.1f} tok/s; prefill {pd_b1_prefill * 1e3:.0f} ms, "
         f"decode {pd_b1_decode_tok_s:.1f} tok/s")
    split = decode_step_split(llm, b1[0][0], b1[0][1], read["kv"])
    _log(f"b1 decode step split: {split}")
    paired = paired_roofline(llm, b1[0][0], b1[0][1], step_bytes, probe, PAIRED_ROUNDS)
    _log(f"b1 roofline fraction, paired rounds: {paired}")
    mixed_tokens = sum(n for _, n in mixed)
    pd_mixed = _pdserve_run(llm, mixed)
    _log(f"pdserve mixed {mixed_tokens / pd_mixed:.1f} tok/s")
    del llm
    peer = _llama_cpp_b1(model, config, b1[0][0], b1[0][1], threads, llama_cpp, probe)
    _log(f"llama.cpp b1: {peer}")
    hf_model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _hf_run(hf_model, [(b1[0][0], 8)], 1)
    hf_b1 = min(_hf_run(hf_model, b1, 1) for _ in range(2))
    _log(f"hf b1 {128 / hf_b1:.1f} tok/s")
    hf_mixed = _hf_run(hf_model, mixed, 32)
    _log(f"hf mixed {mixed_tokens / hf_mixed:.1f} tok/s")
    del hf_model
    bw_after = read_bandwidth_gb_s()
    mem_bw = max(bw_before, bw_after)
    gemv_bw = gemv_bandwidth_gb_s(weight_bytes)
    pd_b1_tok_s = 128 / pd_b1
    if "decode_tok_s_b1" in peer:
        peer["roofline_fraction_b1_run_max_bw"] = round(
            peer["decode_tok_s_b1"] * peer["step_bytes_b1"] / 1e9 / mem_bw, 3)
    return {
        "bench": "engine",
        "model": f"{label} fp32 cpu" + (f" {quantization}" if quantization != "none" else ""),
        "quantization": quantization,
        "threads": threads,
        "pack_weights": pack_weights,
        "weight_bytes": weight_bytes,  # read per decode step by the served weights
        "kv_read_bytes_b1": read["kv"],  # per decode step, at the b1 run's mean context
        "num_mixed_requests": len(mixed),
        "mixed_output_tokens": mixed_tokens,
        "pdserve_tok_s_b1": round(pd_b1_tok_s, 2),
        "pdserve_prefill_s_b1": round(pd_b1_prefill, 4),
        "pdserve_decode_tok_s_b1": round(pd_b1_decode_tok_s, 2),
        "hf_tok_s_b1": round(128 / hf_b1, 2),
        "ratio_b1": round(hf_b1 / pd_b1, 3),
        "pdserve_tok_s_mixed": round(mixed_tokens / pd_mixed, 2),
        "hf_tok_s_mixed": round(mixed_tokens / hf_mixed, 2),
        "ratio_mixed": round(hf_mixed / pd_mixed, 3),
        "mem_bw_gb_s": round(mem_bw, 2),
        "mem_bw_gb_s_before_after": [round(bw_before, 2), round(bw_after, 2)],
        "gemv_bw_gb_s": round(gemv_bw, 2),
        "roofline_fraction_b1": paired["median"],
        "roofline_fraction_b1_paired": paired,
        "roofline_fraction_b1_run_max_bw": round(pd_b1_decode_tok_s * step_bytes / 1e9 / mem_bw, 3),
        "gemv_fraction_b1": round(pd_b1_decode_tok_s * step_bytes / 1e9 / gemv_bw, 3),
        "roofline_fraction_b1_end_to_end": round(pd_b1_tok_s * step_bytes / 1e9 / mem_bw, 3),
        "decode_split_b1": split,
        "llama_cpp": peer,
        **({"llama_cpp_roofline_fraction_b1": peer["roofline_fraction_b1"],
            "llama_cpp_roofline_fraction_b1_run_max_bw": peer["roofline_fraction_b1_run_max_bw"],
            "ratio_decode_b1_llama_cpp": round(pd_b1_decode_tok_s / peer["decode_tok_s_b1"], 3)}
           if "decode_tok_s_b1" in peer else {}),
    }
