"""`pdserve bench engine`'s split of a batch-1 decode step (pdserve.bench.engine_split), on the tiny model:
every decode step counted, the parts inside the step, the model's methods restored. No timing asserted."""

from __future__ import annotations

from pdserve.bench.engine import decode_step_read_bytes
from pdserve.bench.engine_split import decode_step_split
from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import LLM
from pdserve.sampling_params import SamplingParams


def _llm(quantization: str) -> LLM:
    return LLM(EngineConfig(model="tiny", device="cpu", dtype="float32", quantization=quantization,
                            cache=CacheConfig(num_blocks=16, enable_prefix_caching=False)))


def test_every_decode_step_is_split_and_the_model_is_left_as_it_was():
    llm = _llm("int8")
    prompt = list(range(10, 42))
    kv = decode_step_read_bytes(llm, len(prompt) + 4)["kv"]
    split = decode_step_split(llm, prompt, 9, kv)
    assert split["decode_steps"] == 8  # 9 tokens: the prefill's first, then 8 decode steps
    assert 0 < split["forward_ms"] < split["step_ms"] and 0 < split["lm_head_ms"] < split["step_ms"]
    assert split["outside_ms"] >= 0
    model = llm.engine.runner.model
    assert split["forward_bytes"] == decode_step_read_bytes(llm, 0)["weights"] - split["lm_head_bytes"] + kv
    assert split["lm_head_bytes"] > 0 and split["forward_read_gb_s"] > 0 and split["lm_head_read_gb_s"] > 0
    assert "forward" not in vars(model) and "compute_logits" not in vars(model)
    assert not llm.engine.has_unfinished()
    # the engine serves on as before: the same greedy tokens as a fresh engine
    again = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    fresh = _llm("int8").generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert again == fresh[0].token_ids
