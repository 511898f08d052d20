"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log_softmax of the full-prompt
logits: chunked prefill on and off, a prefix-cache hit present, a batch mixed with requests that do not ask, a
prefill-only handoff; block accounting exact."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLM, GenerationRequest
from pdserve.sampling_params import SamplingParams, params_from_dict, params_to_dict

_spec = importlib.util.spec_from_file_location(
    "pdserve_correctness_conftest", Path(__file__).parents[2] / "correctness" / "conftest.py")
_checkpoints = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_checkpoints)
hf_checkpoints = _checkpoints.hf_checkpoints  # the tiny Llama / Qwen2 checkpoints of tests/correctness

K = 3
BLOCK_SIZE = 16


@pytest.fixture(params=["llama", "qwen2"])
def checkpoint(request, hf_checkpoints):
    return hf_checkpoints[request.param]


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(length)]


def _llm(path, chunked: bool = True, budget: int = 24, prefix_caching: bool = True) -> LLM:
    return LLM(EngineConfig(
        model=str(path), device="cpu", dtype="float32",
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=64, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget if chunked else 512,
                                  enable_chunked_prefill=chunked),
    ))


def _params(prompt_logprobs: int | None = K, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=prompt_logprobs,
                          **kw)


@torch.no_grad()
def _hf_prompt_logprobs(hf_model, prompt: list[int], k: int):
    logprobs = hf_model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    chosen = [float(logprobs[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    values, ids = logprobs[:-1].topk(k, dim=-1)
    return chosen, ids.tolist(), values


def _assert_matches_hf(completion, hf_model, prompt: list[int], k: int = K) -> None:
    assert len(completion.prompt_logprobs) == len(completion.prompt_top_logprobs) == len(prompt)
    assert completion.prompt_logprobs[0] is None and completion.prompt_top_logprobs[0] is None
    if len(prompt) == 1:
        return
    chosen, top_ids, top_values = _hf_prompt_logprobs(hf_model, prompt, k)
    torch.testing.assert_close(torch.tensor(completion.prompt_logprobs[1:]), torch.tensor(chosen),
                               rtol=1e-4, atol=1e-4)
    ours = completion.prompt_top_logprobs[1:]
    assert [[t for t, _ in top] for top in ours] == top_ids
    ours_values = torch.tensor([[v for _, v in top] for top in ours])
    torch.testing.assert_close(ours_values, top_values, rtol=1e-4, atol=1e-4)
    assert torch.tensor(chosen).std() > 0.5  # non-degenerate: a constant answer would not pass by chance


def _assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and not llm.engine.requests


@pytest.mark.parametrize("chunked", [True, False])
def test_prompt_logprobs_match_transformers(checkpoint, chunked):
    path, hf_model = checkpoint
    llm = _llm(path, chunked=chunked)
    prompts = [_prompt(70, 0), _prompt(1, 1), _prompt(17, 2)]
    for prompt in prompts:
        (out,) = llm.generate([prompt], _params())
        _assert_matches_hf(out, hf_model, prompt)
        assert out.num_cached_tokens == 0
    (zero,) = llm.generate([prompts[2]], _params(prompt_logprobs=0))
    assert zero.prompt_top_logprobs[1:] == ((),) * 16
    _assert_all_blocks_free(llm)


def test_prompt_spans_chunks(checkpoint):
    path, _ = checkpoint
    llm = _llm(path, budget=24)
    llm.engine.add_request(GenerationRequest("r", tuple(_prompt(70, 0)), _params()))
    deltas = []
    while llm.engine.has_unfinished():
        deltas += llm.engine.step()
    assert deltas[0].num_prefill_chunks == 3 and len(deltas[0].prompt_logprobs) == 70
    assert all(d.prompt_logprobs is None for d in deltas[1:])  # delivered once, on the first token
    _assert_all_blocks_free(llm)


def test_a_prefix_cache_hit_is_not_used_and_the_answer_is_identical(checkpoint):
    path, hf_model = checkpoint
    prompt = _prompt(70, 3)
    (cold,) = _llm(path).generate([prompt], _params())
    llm = _llm(path)
    (warm_up,) = llm.generate([prompt], _params(prompt_logprobs=None))
    assert warm_up.prompt_logprobs is None
    (plain_hit,) = llm.generate([prompt], _params(prompt_logprobs=None))
    assert plain_hit.num_cached_tokens == 64  # the cache holds the prompt's 4 full blocks
    (hot,) = llm.generate([prompt], _params())
    assert hot.num_cached_tokens == 0
    assert hot.prompt_logprobs == cold.prompt_logprobs and hot.prompt_top_logprobs == cold.prompt_top_logprobs
    assert hot.token_ids == cold.token_ids == warm_up.token_ids
    _assert_matches_hf(hot, hf_model, prompt)
    (after,) = llm.generate([prompt], _params(prompt_logprobs=None))
    assert after.num_cached_tokens == 64  # the cache still works for requests that do not ask
    _assert_all_blocks_free(llm)


def test_batch_mixed_with_requests_that_do_not_ask(checkpoint):
    path, hf_model = checkpoint
    prompts = [_prompt(n, 10 + n) for n in (40, 9, 55, 23)]
    others = [_params(prompt_logprobs=None, logprobs=2), _params(prompt_logprobs=None, logprobs=2)]
    llm = _llm(path, budget=32, prefix_caching=False)
    alone = llm.generate([prompts[1], prompts[3]], others)
    mixed = llm.generate(prompts, [_params(), others[0], _params(prompt_logprobs=1, logprobs=1), others[1]])
    for got, want in zip([mixed[1], mixed[3]], alone):
        assert got.prompt_logprobs is None and got.prompt_top_logprobs is None
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs),
                                   rtol=1e-5, atol=1e-5)
    _assert_matches_hf(mixed[0], hf_model, prompts[0])
    _assert_matches_hf(mixed[2], hf_model, prompts[2], k=1)
    for got, prompt in ((mixed[0], prompts[0]), (mixed[2], prompts[2])):
        assert got.token_ids == llm.generate([prompt], _params(prompt_logprobs=None))[0].token_ids
    _assert_all_blocks_free(llm)


def test_prefill_only_delivers_them_with_the_handoff_and_adoption_does_not_repeat_them(checkpoint):
    path, hf_model = checkpoint
    prompt = _prompt(50, 4)
    llm = _llm(path)
    engine = llm.engine
    engine.add_request(GenerationRequest("p", tuple(prompt), _params(), prefill_only=True))
    (first,) = [d for _ in range(10) for d in engine.step()][:1]
    assert first.kv_handoff is not None and len(first.prompt_logprobs) == len(prompt)
    engine.add_request(GenerationRequest("d", tuple(prompt), _params(),
                                         adopt_lease_id=first.kv_handoff.lease_id, first_token_id=first.token_ids[0]))
    rest = []
    while engine.has_unfinished():
        rest += engine.step()
    assert rest and all(d.prompt_logprobs is None for d in rest)
    (whole,) = llm.generate([prompt], _params())
    assert first.prompt_logprobs == whole.prompt_logprobs
    assert [*first.token_ids, *(t for d in rest for t in d.token_ids)] == whole.token_ids
    _assert_all_blocks_free(llm)


def test_params_carry_prompt_logprobs():
    params = SamplingParams(prompt_logprobs=5, logprobs=1)
    assert params_from_dict(params_to_dict(params)) == params
    assert SamplingParams().prompt_logprobs is None
    for bad in (-1, 21):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
