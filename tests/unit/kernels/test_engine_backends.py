"""The engine's greedy output is identical on the Triton path (interpreter here) and the torch path."""

from __future__ import annotations

import random

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLM
from pdserve.models.tiny import ensure_tiny_checkpoint
from pdserve.sampling_params import SamplingParams


def test_tiny_greedy_matches_between_backends(tmp_path):
    tiny = ensure_tiny_checkpoint(tmp_path)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 250) for _ in range(n)] for n in (5, 23, 40)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(EngineConfig(
            model=str(tiny), device="cpu", dtype="float32", attention_backend=backend,
            cache=CacheConfig(num_blocks=64),
            # a small budget mixes decodes with prefill chunks that attend to cached context
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24),
        ))
        assert llm.engine.runner.attention_backend == backend
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs["triton"] == outputs["torch"]
