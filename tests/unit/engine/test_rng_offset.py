"""A seeded request resumed elsewhere (a migrated decode stream) continues its sequence: the prompt plus
the first k tokens, with rng_offset=k, samples exactly the tokens the uninterrupted request sampled next."""

import dataclasses

import pytest

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import GenerationRequest
from pdserve.sampling_params import SamplingParams


def _run(engine: LLMEngine, request: GenerationRequest) -> list[int]:
    engine.add_request(request)
    out: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            out += delta.token_ids
    return out


@pytest.mark.parametrize("k", [1, 7, 19])
def test_resumed_seeded_stream_continues_its_sequence(k):
    engine = LLMEngine(EngineConfig(model="tiny"))
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    full = _run(engine, GenerationRequest("whole", (1, 2, 3, 4), params))
    rest = dataclasses.replace(params, max_tokens=20 - k)
    resumed = _run(engine, GenerationRequest("resumed", (1, 2, 3, 4, *full[:k]), rest, rng_offset=k))
    assert resumed == full[k:]
    fresh = _run(engine, GenerationRequest("fresh", (1, 2, 3, 4, *full[:k]), rest))
    assert fresh != full[k:]  # without the offset the noise repeats from the start: the test can fail


def _run_text(engine: LLMEngine, request: GenerationRequest) -> tuple[list[int], str]:
    engine.add_request(request)
    ids, text = [], ""
    while engine.has_unfinished():
        for delta in engine.step():
            ids += delta.token_ids
            text += delta.text
    return ids, text


@pytest.mark.parametrize("k", [1, 5, 12])
def test_resumed_tokens_keep_text_and_penalties_exact(k):
    """The tiny model's byte-level tokens split characters across tokens, and the penalties count output:
    a resume with num_resumed_tokens=k replays the k tokens into the detokenizer (held partial characters
    carry on) and counts them as output, so ids and text match the uninterrupted request."""
    engine = LLMEngine(EngineConfig(model="tiny"))
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True,
                            presence_penalty=-2.0, frequency_penalty=-2.0)  # repeats output: visible
    full_ids, full_text = _run_text(engine, GenerationRequest("whole", (1, 2, 3, 4), params))
    rest = dataclasses.replace(params, max_tokens=24 - k)
    resumed = GenerationRequest("resumed", (1, 2, 3, 4, *full_ids[:k]), rest, rng_offset=k, num_resumed_tokens=k)
    ids, text = _run_text(engine, resumed)
    assert ids == full_ids[k:]
    prefix = _text_after(engine, params, k)  # what the client had after k tokens
    assert prefix + text == full_text
    unreplayed = _run_text(engine, dataclasses.replace(resumed, request_id="plain", num_resumed_tokens=0))
    assert unreplayed != (ids, text)  # without the replay, penalties or text differ: the test can fail


def _text_after(engine: LLMEngine, params: SamplingParams, k: int) -> str:
    """Text the stream had sent once its first k tokens were out."""
    engine.add_request(GenerationRequest("count", (1, 2, 3, 4), params))
    text, n = "", 0
    while engine.has_unfinished():
        for delta in engine.step():
            if n < k:
                text += delta.text
            n += len(delta.token_ids)
    return text


def test_a_seeded_request_split_across_engines_samples_what_one_engine_samples():
    """Prefill samples the first token with the request's first draw; the adopting engine must go on from
    the second, so placement (split or whole) never changes a seeded stream."""
    prefill, decode = LLMEngine(EngineConfig(model="tiny")), LLMEngine(EngineConfig(model="tiny"))
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1005, ignore_eos=True)
    prompt = tuple(range(5, 45))
    whole = _run(LLMEngine(EngineConfig(model="tiny")), GenerationRequest("whole", prompt, params))
    prefill.add_request(GenerationRequest("pre", prompt, params, prefill_only=True))
    (delta,) = prefill.step()
    handoff = delta.kv_handoff
    lease = decode.reserve_kv(handoff.num_tokens)
    for src, dst in zip(handoff.block_ids, lease.block_ids):
        decode.runner.kv_pool[dst].copy_(prefill.runner.kv_pool[src])
    prefill.release_lease(handoff.lease_id)
    rest = _run(decode, GenerationRequest("dec", prompt, params, adopt_lease_id=lease.lease_id,
                                          first_token_id=delta.token_ids[0]))
    assert [*delta.token_ids, *rest] == whole
    reused = _run(LLMEngine(EngineConfig(model="tiny")),
                  GenerationRequest("again", (*prompt, whole[0]), dataclasses.replace(params, max_tokens=15)))
    assert reused != whole[1:]  # the first draw used twice changes the stream: the test can fail
