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


def decode_tokens_per_s(model: str, kv_cache_dtype: str, steps: int = 5, seed: int = 0) -> dict:
    block_size = 16
    blocks_per_seq = CONTEXT // block_size
    config = EngineConfig(model=model, device="cpu", dtype="float32",
                          cache=CacheConfig(block_size=block_size, num_blocks=BATCH * blocks_per_seq + 1,
                                            kv_cache_dtype=kv_cache_dtype))
    engine = LLMEngine(config)
    _fill(engine, seed)
    runner = engine.runner
    seqs = [_Decoding(CONTEXT, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))) for i in range(BATCH)]
    # the new token sits at position CONTEXT - 1 of each sequence (its slot is overwritten every step)
    slots = [s.block_table[-1] * block_size + block_size - 1 for s in seqs]
    to = dict(dtype=torch.int64, device=runner.device)
    input_ids = torch.randint(0, engine.model_config.vocab_size, (BATCH,), generator=torch.Generator().manual_seed(seed))
    positions = torch.full((BATCH,), CONTEXT - 1, **to)
    times = []
    with torch.inference_mode():
        for step in range(steps + 1):  # the first step warms up
            begin = time.perf_counter()
            meta = runner._metadata(seqs, slots, [])
            hidden = runner.model(input_ids, positions, runner.kv_caches, meta)
            runner.model.compute_logits(hidden)
            if step:
                times.append(time.perf_counter() - begin)
    pool_bytes = runner.kv_pool.numel() * runner.kv_pool.element_size()
    del engine
    step_s = sorted(times)[len(times) // 2]
    return {"tok_s": round(BATCH / step_s, 2), "step_ms_median": round(step_s * 1e3, 1), "steps": steps,
            "kv_read_bytes_per_step": pool_bytes * BATCH * blocks_per_seq // (BATCH * blocks_per_seq + 1)}
