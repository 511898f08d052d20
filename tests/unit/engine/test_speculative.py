"""Speculative decoding on the tiny model: outputs identical to plain decoding, limits inside drafts, pool exact."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from pdserve.engine import GenerationRequest, LLMEngine
from pdserve.engine.spec import PROPOSERS, create_proposer
from pdserve.engine.spec.ngram import NgramProposer
from pdserve.models.tiny import ensure_tiny_checkpoint
from pdserve.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = [
    [5, 6, 7, 8, 9] * 6,
    [40, 41, 42, 43] * 5 + [44, 45],
    list(range(100, 140)),
    [7, 7, 3, 9, 7, 7, 3, 9, 1, 2],
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny-spec"))


def make_engine(tiny_dir: Path, k: int | None, num_blocks: int = 64, **scheduler) -> LLMEngine:
    spec = None if k is None else SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3)
    return LLMEngine(EngineConfig(
        model=str(tiny_dir), device="cpu", dtype="float32", speculative=spec,
        cache=CacheConfig(num_blocks=num_blocks, block_size=4), scheduler=SchedulerConfig(**scheduler),
    ))


@pytest.fixture(scope="module")
def plain(tiny_dir: Path) -> LLMEngine:
    return make_engine(tiny_dir, None)


@pytest.fixture(scope="module")
def spec(tiny_dir: Path) -> LLMEngine:
    return make_engine(tiny_dir, 5)


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, stagger: int = 0) -> list[Result]:
    """Each request in turn; with `stagger`, one more joins every `stagger` steps (prefills beside decodes)."""
    results = [Result() for _ in prompts]
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_unfinished():
        while pending and (not stagger or steps % stagger == 0 or not engine.has_unfinished()):
            i, prompt = pending.pop(0)
            engine.add_request(GenerationRequest(str(i), prompt, params))
            if stagger:
                break
        for delta in engine.step():
            r = results[int(delta.request_id)]
            r.token_ids.extend(delta.token_ids)
            r.text += delta.text
            r.logprobs.extend(delta.logprobs or ())
            if delta.finished:
                r.finish_reason, r.stop_reason = delta.finish_reason, delta.stop_reason
        steps += 1
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.speculative_blocks
    return results


# --- proposer -------------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(1, 3)
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2) == [8, 1]  # latest of the 3-gram
    assert proposer.propose([4, 2, 3, 5, 6, 7, 2, 3], 5) == [5, 6, 7, 2, 3]
    assert proposer.propose([1, 2, 3, 4], 3) == []
    assert proposer.propose([5, 1, 5], 3) == [1, 5, 1]  # runs into the end: continues with period 2
    assert proposer.propose([9, 1, 2, 3, 1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]
    assert NgramProposer(2, 3).propose([5, 1, 5], 3) == []  # a 1-gram is below the minimum
    assert proposer.propose([1, 1], 0) == []


def test_registry_builds_the_configured_method():
    assert "ngram" in PROPOSERS
    assert isinstance(create_proposer(SpeculativeConfig()), NgramProposer)
    with pytest.raises(ValueError, match="unknown speculative method"):
        create_proposer(SpeculativeConfig(method="medusa"))
    with pytest.raises(ValueError):
        SpeculativeConfig(num_speculative_tokens=0)


def test_drafter_caps_adapt_to_acceptance_and_limits():
    from pdserve.engine.sequence import Sequence
    from pdserve.engine.spec import Drafter

    drafter = Drafter(NgramProposer(1, 2), 8, max_model_len=64, disable_by_batch_size=4)
    seq = Sequence("r", [1, 2, 3, 4, 5] * 4, SamplingParams(max_tokens=30), 4)
    seq.token_ids.append(1)  # one output token: decoding
    assert len(drafter.draft(seq, budget=100)) == 8
    assert len(drafter.draft(seq, budget=3)) == 3
    drafter.observe(seq, 8, 2)  # rejected at the third: next draft at most 3
    assert len(drafter.draft(seq, budget=100)) == 3
    drafter.observe(seq, 3, 3)  # all accepted: the cap doubles
    assert len(drafter.draft(seq, budget=100)) == 6
    near_end = Sequence("e", [1, 2, 3, 4, 5] * 4, SamplingParams(max_tokens=3), 4)
    near_end.token_ids += [1, 2]
    assert len(drafter.draft(near_end, budget=100)) == 0  # the bonus token is the last one allowed
    long = Sequence("l", [1, 2, 3, 4, 5] * 12, SamplingParams(max_tokens=30), 4)
    long.token_ids += [1]
    assert len(drafter.draft(long, budget=100)) == 64 - 61
    assert drafter.is_enabled(4) and not drafter.is_enabled(5)


# --- identity with plain decoding -----------------------------------------------------------------


def test_greedy_identical_and_drafts_accepted(plain, spec):
    params = SamplingParams(max_tokens=40, **GREEDY)
    before = spec.num_accepted_tokens
    assert generate(spec, PROMPTS, params) == generate(plain, PROMPTS, params)
    assert spec.num_accepted_tokens > before  # the test exercised acceptance, not just plain decodes


def test_mixed_batch_with_prefills_joining(plain, spec):
    params = SamplingParams(max_tokens=24, **GREEDY)
    expected = generate(plain, PROMPTS * 2, params, stagger=3)
    assert generate(spec, PROMPTS * 2, params, stagger=3) == expected


def test_tight_pool_and_preemption_stay_identical(tiny_dir, plain):
    tight = make_engine(tiny_dir, 4, num_blocks=30, max_num_batched_tokens=16, max_num_seqs=4)
    params = SamplingParams(max_tokens=30, **GREEDY)
    assert generate(tight, PROMPTS, params) == generate(plain, PROMPTS, params)
    assert tight.num_preemptions > 0 and tight.num_accepted_tokens > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8])
def test_max_tokens_inside_a_draft(plain, spec, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    out = generate(spec, PROMPTS, params)
    assert out == generate(plain, PROMPTS, params)
    assert all(len(r.token_ids) == max_tokens and r.finish_reason == "length" for r in out)


def test_stop_string_and_stop_token_inside_a_draft(plain, spec):
    accepted = spec.num_accepted_tokens
    free = generate(plain, PROMPTS[:2], SamplingParams(max_tokens=30, **GREEDY))
    for r, prompt in zip(free, PROMPTS[:2]):
        # a token well past the first draft, first occurring there (so the stop falls on it)
        index = next(i for i in range(6, 30) if r.token_ids[i] not in r.token_ids[:i])
        for params in (
            SamplingParams(max_tokens=30, stop_token_ids=(r.token_ids[index],), **GREEDY),
            SamplingParams(max_tokens=30, stop=(plain.tokenizer.decode(r.token_ids[index : index + 2]),), **GREEDY),
            SamplingParams(max_tokens=30, stop_token_ids=(r.token_ids[index],), min_tokens=index + 3, **GREEDY),
        ):
            expected = generate(plain, [prompt], params)
            assert generate(spec, [prompt], params) == expected
            assert expected[0].finish_reason in ("stop", "length")
    assert spec.num_accepted_tokens > accepted


def test_logprobs_and_penalties_as_without_drafts(plain, spec):
    params = SamplingParams(max_tokens=20, logprobs=3, repetition_penalty=1.2, frequency_penalty=0.3, **GREEDY)
    out, expected = generate(spec, PROMPTS, params), generate(plain, PROMPTS, params)
    for a, b in zip(out, expected):
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_seeded_sampling_reproducible(spec):
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    first = generate(spec, PROMPTS, params)
    assert generate(spec, PROMPTS, params) == first
    assert len({tuple(r.token_ids) for r in first}) == len(PROMPTS)


def test_adopted_kv_then_speculation(tiny_dir, plain, spec):
    """The disaggregated path inside one engine: prefill-only, lease, adopt, then speculate."""
    params = SamplingParams(max_tokens=24, **GREEDY)
    expected = generate(plain, PROMPTS[:2], params)
    for prompt, want in zip(PROMPTS[:2], expected):
        spec.add_request(GenerationRequest("p", prompt, params, prefill_only=True))
        (first,) = [d for d in spec.step() if d.request_id == "p"]
        handoff = first.kv_handoff
        before = spec.num_verifications
        spec.add_request(GenerationRequest("d", prompt, params, adopt_lease_id=handoff.lease_id,
                                           first_token_id=first.token_ids[0]))
        tokens, last = list(first.token_ids), None
        while spec.has_unfinished():
            for delta in spec.step():
                tokens.extend(delta.token_ids)
                last = delta
        assert tokens == want.token_ids
        assert spec.num_verifications > before
        # the request's own counts ride on its deltas (cumulative), the engine's on its stats
        assert 0 < last.num_verifications <= last.num_draft_tokens and last.num_accepted_tokens <= last.num_draft_tokens
        assert spec.stats().num_spec_verifications == spec.num_verifications
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks
