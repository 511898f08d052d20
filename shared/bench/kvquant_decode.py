"""Decode steps at batch 32 over 1,024-token contexts, on a pool filled with synthetic KV.

Prefilling 32 x 1,024 real tokens costs minutes on a CPU, and a decode step's cost does not depend on
what the cached values are, so the pool is filled with random values (int8: random bytes and scales
of 0.02) and every sequence owns 64 blocks of its own. Each step runs the model as the engine does
(ModelRunner's metadata and decode grouping, the same attention path), logits included, sampling not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import LLMEngine
from pdserve.kernels.kv_quant import QuantizedCache

BATCH = 32
CONTEXT = 1024


@dataclass
class _Decoding:
    """What ModelRunner._metadata reads of a sequence: its length and block table."""

    num_tokens: int
    block_table: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return self.num_tokens


def _fill(engine: LLMEngine, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for k_cache, v_cache in engine.runner.kv_caches:
        for cache in (k_cache, v_cache):
            if isinstance(cache, QuantizedCache):
                cache.data.view(torch.uint8).copy_(
                    torch.randint(0, 255, cache.data.shape, generator=gen, dtype=torch.uint8)  # int8 bytes
                )
                cache.scale.fill_(0.02)
    if not isinstance(engine.runner.kv_caches[0][0], QuantizedCache):
        engine.runner.kv_pool.normal_(generator=gen)


class _Stepper:
    """One engine with BATCH sequences of CONTEXT tokens in a synthetic pool, stepped as the engine would."""

    def __init__(self, model: str, kv_cache_dtype: str, seed: int) -> None:
        block_size = 16
        blocks_per_seq = CONTEXT // block_size
        config = EngineConfig(model=model, device="cpu", dtype="float32",
                              cache=CacheConfig(block_size=block_size, num_blocks=BATCH * blocks_per_seq + 1,
                                                kv_cache_dtype=kv_cache_dtype))
        self.engine = LLMEngine(config)
        _fill(self.engine, seed)
        self.runner = self.engine.runner
        self.seqs = [_Decoding(CONTEXT, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
                     for i in range(BATCH)]
        # the new token sits at position CONTEXT - 1 of each sequence (its slot is overwritten every step)
        self.slots = [s.block_table[-1] * block_size + block_size - 1 for s in self.seqs]
        vocab = self.engine.model_config.vocab_size
        self.input_ids = torch.randint(0, vocab, (BATCH,), generator=torch.Generator().manual_seed(seed))
        self.positions = torch.full((BATCH,), CONTEXT - 1, dtype=torch.int64)
        pool = self.runner.kv_pool
        self.kv_bytes = pool.numel() * pool.element_size() * (BATCH * blocks_per_seq) // pool.shape[0]

    @torch.inference_mode()
    def step_s(self) -> float:
        begin = time.perf_counter()
        meta = self.runner._metadata(self.seqs, self.slots, [])
        hidden = self.runner.model(self.input_ids, self.positions, self.runner.kv_caches, meta)
        self.runner.model.compute_logits(hidden)
        return time.perf_counter() - begin


def decode_tokens_per_s(model: str, kv_cache_dtypes: tuple[str, ...], steps: int = 5, seed: int = 0) -> dict:
    """Steps of each KV dtype interleaved (a, b, a, b, ...) after one warm-up each, so that a machine
    shared with other work slows them alike; tokens/s from the median step."""
    steppers = {kv: _Stepper(model, kv, seed) for kv in kv_cache_dtypes}
    for stepper in steppers.values():
        stepper.step_s()
    times: dict[str, list[float]] = {kv: [] for kv in kv_cache_dtypes}
    for _ in range(steps):
        for kv, stepper in steppers.items():
            times[kv].append(stepper.step_s())
    out = {}
    for kv, samples in times.items():
        median = sorted(samples)[len(samples) // 2]
        out[kv] = {"tok_s": round(BATCH / median, 2), "step_ms_median": round(median * 1e3, 1),
                   "step_ms_min": round(min(samples) * 1e3, 1), "steps": steps,
                   "kv_bytes_read_per_step": steppers[kv].kv_bytes}
    return out
