"""`python -m pdserve.bench.tp --json`: tensor parallelism's parity and cost on this machine.

Parity: prefill logits at every position of a prompt, TP=2 against TP=1 (max_abs_logit_diff_tp2), and
32 greedy tokens on 4 chat prompts through the engine (greedy_identical). Cost: a 1k-token prefill and a
decode step at batch 1 and 16 (every sequence attends the same prefilled 1k-token context, plus a block
of its own), for TP=1 (all cores in one process) and TP=2 (the cores split between the ranks), with the
share of the driver's step spent in all-reduces (communication plus waiting for the slower rank). Handoff:
at TP=2, gathering the 1k-token prompt's blocks from the ranks into the whole model's layout (what a
prefill replica does before exporting) and scattering them back (what a decode replica does on adopting),
with the bytes moved and a copy of those bytes between two buffers of one process as the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field

import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLMEngine
from pdserve.engine.llm import LLM
from pdserve.models.attention import AttentionMetadata, PrefillChunk
from pdserve.models.tensor_parallel import all_reduce_seconds
from pdserve.sampling_params import SamplingParams

CHAT_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                "Explain what a KV cache is in one sentence.", "List three prime numbers.")
PREFILL_TOKENS = 1024
BLOCK_SIZE = 16


@dataclass
class _Decoding:
    """What ModelRunner._metadata reads of a sequence: its length and block table."""

    num_tokens: int
    block_table: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return self.num_tokens


def engine_config(model: str, tp: int, num_blocks: int = 128) -> EngineConfig:
    threads = max(1, (os.cpu_count() or 1) // tp)
    return EngineConfig(model=model, device="cpu", dtype="float32", tensor_parallel_size=tp, num_threads=threads,
                        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_model_len=PREFILL_TOKENS + 64))


@torch.inference_mode()
def prefill_logits(engine: LLMEngine, token_ids: list[int], all_rows: bool = True,
                   block_ids: list[int] | None = None) -> torch.Tensor:
    """Prefill `token_ids` on every rank, as a step would, into `block_ids` (default: blocks taken from the
    block manager for the call, so no cached prefix is overwritten); logits [T, V], or [1, V] for the last."""
    runner, n = engine.runner, len(token_ids)
    own = block_ids is None
    blocks = engine.block_manager.allocate_blocks(-(-n // runner.block_size)) if own else block_ids
    try:
        chunk = PrefillChunk(0, n, n, torch.tensor(blocks))
        slots = torch.tensor([blocks[p // runner.block_size] * runner.block_size + p % runner.block_size
                              for p in range(n)])
        meta = AttentionMetadata(slots, 0, (), (chunk,), backend=runner.attention_backend)
        hidden = runner.model(torch.tensor(token_ids), torch.arange(n), runner.kv_caches, meta)
        return runner.model.compute_logits(hidden if all_rows else hidden[-1:])
    finally:
        if own:
            engine.block_manager.release_blocks(blocks)


@torch.inference_mode()
def decode_step_s(engine: LLMEngine, batch: int, context_blocks: list[int], own_blocks: list[int],
                  seed: int = 0) -> float:
    """One decode step of `batch` sequences, each over the prefilled `context_blocks` (shared) plus a block
    of its own from `own_blocks` for the new token, logits included."""
    runner, bs = engine.runner, engine.runner.block_size
    context = len(context_blocks) * bs
    seqs = [_Decoding(context + 1, context_blocks + [own_blocks[i]]) for i in range(batch)]
    slots = [s.block_table[-1] * bs for s in seqs]
    ids = torch.randint(0, engine.model_config.vocab_size, (batch,), generator=torch.Generator().manual_seed(seed))
    begin = time.perf_counter()
    meta = runner._metadata(seqs, slots, [])
    hidden = runner.model(ids, torch.full((batch,), context, dtype=torch.int64), runner.kv_caches, meta)
    runner.model.compute_logits(hidden)
    return time.perf_counter() - begin


def _allreduce_s(engine: LLMEngine) -> float:
    return all_reduce_seconds(engine.runner.model)[0] if engine.tensor_parallel is not None else 0.0


def _timed(engine: LLMEngine, fn, repeats: int) -> dict:
    times, shares = [], []
    for _ in range(repeats):
        before = _allreduce_s(engine)
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        times.append(elapsed)
        shares.append((_allreduce_s(engine) - before) / elapsed)
    median = sorted(range(repeats), key=times.__getitem__)[repeats // 2]
    return {"ms": round(times[median] * 1e3, 2), "ms_min": round(min(times) * 1e3, 2),
            "allreduce_share": round(shares[median], 3)}


def _handoff(engine: LLMEngine, block_ids: list[int], prefill_ms: float, repeats: int) -> dict:
    kv = engine.sharded_kv
    kv.gather(block_ids)  # warm-up; allocates the whole-model pool
    canonical = kv.canonical[block_ids]
    nbytes = canonical.numel() * canonical.element_size()
    into = torch.empty_like(canonical)  # faulted in once, as the pools are: the reference is the copy alone
    into.copy_(canonical)
    copy = _timed(engine, lambda: into.copy_(canonical), repeats)
    gather = _timed(engine, lambda: kv.gather(block_ids), repeats)
    scatter = _timed(engine, lambda: kv.scatter(block_ids), repeats)
    return {"handoff_kv_bytes_1k": nbytes,
            "handoff_gather_1k": {k: gather[k] for k in ("ms", "ms_min")},
            "handoff_scatter_1k": {k: scatter[k] for k in ("ms", "ms_min")},
            "handoff_copy_1k": {k: copy[k] for k in ("ms", "ms_min")},
            "handoff_gather_over_copy": round(gather["ms"] / copy["ms"], 2),
            "handoff_gather_over_prefill_1k": round(gather["ms"] / prefill_ms, 4)}


def _chat_ids(llm: LLM, prompt: str) -> list[int]:
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return llm.tokenizer.encode(chat, add_special_tokens=False)


def run(model: str = "smollm2-135m-instruct", quick: bool = False, seed: int = 0) -> dict:
    repeats = 3 if quick else 7
    llms = {tp: LLM(engine_config(model, tp)) for tp in (1, 2)}
    try:
        vocab = llms[1].engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(seed)
        probe = torch.randint(0, vocab, (128,), generator=gen).tolist()
        logits = {tp: prefill_logits(llm.engine, probe) for tp, llm in llms.items()}
        max_diff = (logits[2] - logits[1]).abs().max().item()
        prompts = [_chat_ids(llms[1], p) for p in CHAT_PROMPTS]
        params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        tokens = {tp: [c.token_ids for c in llm.generate(prompts, params)] for tp, llm in llms.items()}
        long_prompt = torch.randint(0, vocab, (PREFILL_TOKENS,), generator=gen).tolist()
        result: dict = {"model": model, "cpus": os.cpu_count(), "max_abs_logit_diff_tp2": max_diff,
                        "greedy_identical": tokens[1] == tokens[2], "greedy_prompts": len(prompts),
                        "greedy_tokens": 32}
        timings: dict = {}
        blocks = {tp: llm.engine.block_manager.allocate_blocks(PREFILL_TOKENS // BLOCK_SIZE + 16)
                  for tp, llm in llms.items()}
        context, own = PREFILL_TOKENS // BLOCK_SIZE, slice(PREFILL_TOKENS // BLOCK_SIZE, None)
        steps = [("prefill_1k", lambda e, b: prefill_logits(e, long_prompt, all_rows=False, block_ids=b[:context])),
                 ("decode_b1", lambda e, b: decode_step_s(e, 1, b[:context], b[own], seed)),
                 ("decode_b16", lambda e, b: decode_step_s(e, 16, b[:context], b[own], seed))]
        for name, fn in steps:
            for tp, llm in llms.items():
                fn(llm.engine, blocks[tp])  # warm-up (and, for prefill, the context the decodes attend)
                timings.setdefault(f"tp{tp}", {})[name] = _timed(
                    llm.engine, lambda e=llm.engine, b=blocks[tp], f=fn: f(e, b), repeats)
        result.update(timings)
        result.update(_handoff(llms[2].engine, blocks[2][:context], timings["tp2"]["prefill_1k"]["ms"], repeats))
        for name in ("prefill_1k", "decode_b1", "decode_b16"):
            result[f"{name}_tp2_over_tp1"] = round(timings["tp2"][name]["ms"] / timings["tp1"][name]["ms"], 3)
        return result
    finally:
        for llm in llms.values():
            llm.engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench tp", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="one-line JSON")
    args = parser.parse_args(argv)
    result = run(model=args.model, quick=args.quick, seed=args.seed)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
