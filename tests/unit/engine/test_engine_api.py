"""LLMEngine / LLM on the embedded tiny model: stop conditions, validation, logprobs, seeded sampling."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLM, GenerationRequest, LLMEngine, TokenDelta
from pdserve.models.tiny import TINY_CONFIG, ensure_tiny_checkpoint
from pdserve.sampling_params import SamplingParams

NUM_BLOCKS = 64
VOCAB = TINY_CONFIG["vocab_size"]
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny-engine-api"))


def make_config(tiny_dir: Path, num_blocks: int = NUM_BLOCKS, **scheduler) -> EngineConfig:
    return EngineConfig(
        model=str(tiny_dir), device="cpu", dtype="float32",
        cache=CacheConfig(num_blocks=num_blocks, block_size=16), scheduler=SchedulerConfig(**scheduler),
    )


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    return LLM(make_config(tiny_dir))


@pytest.fixture
def engine(llm: LLM) -> LLMEngine:
    # One engine per module (loads once); every test must leave it idle with the whole pool free.
    yield llm.engine
    assert not llm.engine.requests
    assert llm.engine.block_manager.num_free_blocks == NUM_BLOCKS


def prompt(i: int) -> tuple[int, ...]:
    return tuple(f"prompt {i}".encode())


def run(engine: LLMEngine, *requests: GenerationRequest) -> dict[str, list[TokenDelta]]:
    for request in requests:
        engine.add_request(request)
    deltas: dict[str, list[TokenDelta]] = {r.request_id: [] for r in requests}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
    assert not engine.has_unfinished()
    for request_id, stream in deltas.items():
        assert stream and stream[-1].finished, request_id
        assert not any(d.finished for d in stream[:-1]), request_id
    return deltas


def tokens_of(stream: list[TokenDelta]) -> list[int]:
    return [t for d in stream for t in d.token_ids]


def text_of(stream: list[TokenDelta]) -> str:
    return "".join(d.text for d in stream)


def generate_one(engine: LLMEngine, prompt_ids, request_id: str = "r", **params) -> list[TokenDelta]:
    return run(engine, GenerationRequest(request_id, tuple(prompt_ids), SamplingParams(**params)))[request_id]


@pytest.fixture(scope="module")
def eos_case(llm: LLM) -> tuple[tuple[int, ...], int, list[int]]:
    """A prompt whose greedy continuation (ignoring eos) contains an eos id at index k >= 1."""
    prompts = [prompt(i) for i in range(60)]
    outs = llm.generate([list(p) for p in prompts], SamplingParams(max_tokens=8, **GREEDY))
    for p, out in zip(prompts, outs):
        eos_at = [k for k, t in enumerate(out.token_ids) if t in llm.tokenizer.eos_token_ids]
        if eos_at and eos_at[0] >= 1:
            return p, eos_at[0], out.token_ids
    pytest.fail("no greedy continuation of the probe prompts produces eos; widen the probe")


# --- max_tokens, eos, stop ids ------------------------------------------------------------------


def test_max_tokens_stops_with_length_one_token_per_delta(engine: LLMEngine) -> None:
    stream = generate_one(engine, prompt(1), max_tokens=7, **GREEDY)
    assert [len(d.token_ids) for d in stream] == [1] * 7
    assert [d.num_output_tokens for d in stream] == list(range(1, 8))
    last = stream[-1]
    assert (last.finish_reason, last.stop_reason) == ("length", None)
    assert last.num_prompt_tokens == len(prompt(1))


def test_llm_generate_matches_engine_and_greedy_is_deterministic(engine: LLMEngine, llm: LLM) -> None:
    stream = generate_one(engine, prompt(2), max_tokens=9, **GREEDY)
    out_a, out_b = llm.generate([list(prompt(2)), list(prompt(2))], SamplingParams(max_tokens=9, **GREEDY))
    assert out_a.token_ids == out_b.token_ids == tokens_of(stream)
    assert out_a.text == text_of(stream)
    assert out_a.finish_reason == "length"


def test_eos_stops_unless_ignore_eos(engine: LLMEngine, llm: LLM, eos_case) -> None:
    p, k, ref = eos_case
    stopped = generate_one(engine, p, max_tokens=8, temperature=0.0)
    assert tokens_of(stopped) == ref[: k + 1]
    assert (stopped[-1].finish_reason, stopped[-1].stop_reason) == ("stop", None)
    assert llm.tokenizer.decode(ref[k:k + 1]) == ""  # eos is special: no text for it
    ignored = generate_one(engine, p, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert tokens_of(ignored) == ref
    assert ignored[-1].finish_reason == "length"


def test_stop_token_id_stops_with_the_id_as_reason(engine: LLMEngine) -> None:
    ref = tokens_of(generate_one(engine, prompt(3), max_tokens=10, **GREEDY))
    j = next(j for j in range(2, 10) if ref[j] not in ref[:j])
    stream = generate_one(engine, prompt(3), max_tokens=10, stop_token_ids=(ref[j],), **GREEDY)
    assert tokens_of(stream) == ref[: j + 1]
    assert (stream[-1].finish_reason, stream[-1].stop_reason) == ("stop", ref[j])


def test_min_tokens_masks_eos(engine: LLMEngine, llm: LLM, eos_case) -> None:
    p, k, ref = eos_case
    eos = llm.tokenizer.eos_token_ids
    stream = generate_one(engine, p, max_tokens=k + 6, min_tokens=k + 2, temperature=0.0)
    out = tokens_of(stream)
    assert out[:k] == ref[:k]  # greedy until the masked position
    assert len(out) >= k + 2 and not eos & set(out[: k + 2])
    assert stream[-1].finish_reason == ("stop" if out[-1] in eos else "length")


def test_min_tokens_masks_stop_token_ids(engine: LLMEngine) -> None:
    ref = tokens_of(generate_one(engine, prompt(3), max_tokens=10, **GREEDY))
    j = next(j for j in range(2, 10) if ref[j] not in ref[:j])
    stream = generate_one(
        engine, prompt(3), max_tokens=j + 6, min_tokens=j + 2, stop_token_ids=(ref[j],), **GREEDY
    )
    out = tokens_of(stream)
    assert out[:j] == ref[:j] and out[j] != ref[j]
    assert len(out) >= j + 2 and ref[j] not in out[: j + 2]
    if stream[-1].finish_reason == "stop":
        assert stream[-1].stop_reason == out[-1] == ref[j]


# --- stop strings --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def text_case(llm: LLM) -> tuple[tuple[int, ...], list[int], str, str]:
    """A greedy continuation and a two-character ASCII stop string first occurring inside its text."""
    for i in range(40):
        out = llm.generate([list(prompt(i))], SamplingParams(max_tokens=24, **GREEDY))[0]
        text = out.text
        for pos in range(1, len(text) - 2):
            candidate = text[pos : pos + 2]
            if all(c.isascii() and c.isalnum() for c in candidate) and text.find(candidate) == pos:
                return prompt(i), out.token_ids, text, candidate
    pytest.fail("no printable two-character stop string in the probe continuations")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates_text_and_never_leaks_a_prefix(engine: LLMEngine, text_case, include) -> None:
    p, ref, text, stop = text_case
    stream = generate_one(
        engine, p, max_tokens=24, stop=(stop,), include_stop_str_in_output=include, **GREEDY
    )
    pos = text.find(stop)
    expected = text[: pos + len(stop)] if include else text[:pos]
    emitted = ""
    for delta in stream:
        emitted += delta.text
        # committed text is final: what has been streamed is always a prefix of the answer
        assert expected.startswith(emitted)
    assert emitted == expected
    assert (stream[-1].finish_reason, stream[-1].stop_reason) == ("stop", stop)
    out = tokens_of(stream)
    assert out == ref[: len(out)] and len(out) < len(ref)


def test_held_stop_prefix_is_released_at_length(engine: LLMEngine, text_case) -> None:
    p, ref, text, stop = text_case
    never = text[-1] + "\x00never"  # its first character ends the output, so it is held until the end
    stream = generate_one(engine, p, max_tokens=24, stop=(never,), **GREEDY)
    assert text_of(stream) == text
    assert stream[-1].finish_reason == "length"
    assert tokens_of(stream) == ref


def test_stop_token_id_releases_held_text(engine: LLMEngine, text_case) -> None:
    p, ref, text, stop = text_case
    j = next(
        j for j in range(2, len(ref))
        if ref[j] not in ref[:j] and ref[j - 1] < 128 and chr(ref[j - 1]).isalnum()
    )
    # the token before the stop id starts a stop string, so its text is held when the stop id arrives
    held = chr(ref[j - 1]) + "\x00never"
    stream = generate_one(engine, p, max_tokens=24, stop=(held,), stop_token_ids=(ref[j],), **GREEDY)
    assert tokens_of(stream) == ref[: j + 1]
    assert (stream[-1].finish_reason, stream[-1].stop_reason) == ("stop", ref[j])
    assert stream[-1].text.startswith(chr(ref[j - 1]))
    assert text_of(stream) == text_of(generate_one(engine, p, max_tokens=j, **GREEDY))


# --- validation ----------------------------------------------------------------------------------


def test_invalid_requests_raise_and_hold_nothing(tiny_dir: Path) -> None:
    engine = LLMEngine(make_config(tiny_dir, max_model_len=64))
    free = engine.block_manager.num_free_blocks
    engine.add_request(GenerationRequest("dup", prompt(1), SamplingParams(max_tokens=3, **GREEDY)))
    bad = [
        GenerationRequest("long", (1,) * 60, SamplingParams(max_tokens=5)),
        GenerationRequest("vocab-high", (1, VOCAB), SamplingParams(max_tokens=2)),
        GenerationRequest("vocab-neg", (1, -1), SamplingParams(max_tokens=2)),
        GenerationRequest("dup", prompt(2), SamplingParams(max_tokens=2)),
    ]
    for request in bad:
        with pytest.raises(ValueError):
            engine.add_request(request)
        assert list(engine.requests) == ["dup"]
        assert engine.scheduler.num_waiting == 1 and engine.scheduler.num_running == 0
        assert engine.block_manager.num_free_blocks == free
    with pytest.raises(ValueError):
        GenerationRequest("empty", ())
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=2, min_tokens=3)
    # the exact limit is accepted, and the duplicate did not disturb the original request
    engine.add_request(GenerationRequest("edge", (1,) * 59, SamplingParams(max_tokens=5, **GREEDY)))
    deltas: dict[str, list[TokenDelta]] = {"dup": [], "edge": []}
    while engine.has_unfinished():
        for delta in engine.step():
            deltas[delta.request_id].append(delta)
    assert len(tokens_of(deltas["dup"])) == 3 and len(tokens_of(deltas["edge"])) == 5
    assert deltas["edge"][-1].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == free


def test_llm_generate_rejects_a_bad_batch_without_leftovers(llm: LLM, engine: LLMEngine) -> None:
    with pytest.raises(ValueError):
        llm.generate([list(prompt(1)), [VOCAB + 5]], SamplingParams(max_tokens=3))
    assert not engine.requests
    with pytest.raises(ValueError):
        llm.generate([list(prompt(1)), list(prompt(2))], [SamplingParams(max_tokens=3)])
    assert not engine.requests
    out = llm.generate([list(prompt(1))], SamplingParams(max_tokens=3, **GREEDY))
    assert len(out) == 1 and len(out[0].token_ids) == 3


def test_abort_frees_waiting_and_running_requests(engine: LLMEngine) -> None:
    for i in range(3):
        engine.add_request(GenerationRequest(f"a{i}", prompt(i) * 4, SamplingParams(max_tokens=20, **GREEDY)))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < NUM_BLOCKS
    assert engine.abort("a1") and not engine.abort("a1") and not engine.abort("missing")
    assert engine.abort("a0") and engine.abort("a2")
    assert engine.scheduler.num_waiting == engine.scheduler.num_running == 0


# --- logprobs ------------------------------------------------------------------------------------


def test_logprobs_carry_the_sampled_token_and_top_n(engine: LLMEngine) -> None:
    ref = tokens_of(generate_one(engine, prompt(4), max_tokens=6, **GREEDY))
    stream = generate_one(engine, prompt(4), max_tokens=6, logprobs=3, **GREEDY)
    assert tokens_of(stream) == ref  # asking for logprobs does not change sampling
    for delta in stream:
        assert delta.logprobs is not None and len(delta.logprobs) == 1
        assert delta.top_logprobs is not None and len(delta.top_logprobs) == 1
        (sampled_lp,), (top,) = delta.logprobs, delta.top_logprobs
        assert len(top) == 3 and len({t for t, _ in top}) == 3
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True) and all(lp <= 0.0 for lp in values)
        assert sum(math.exp(lp) for lp in values) <= 1.0 + 1e-5
        assert top[0][0] == delta.token_ids[0]  # greedy picks the top entry
        assert sampled_lp == pytest.approx(top[0][1], abs=1e-6)


def test_logprobs_zero_and_none(engine: LLMEngine) -> None:
    zero = generate_one(engine, prompt(5), max_tokens=3, logprobs=0, temperature=0.8, seed=3)
    assert all(d.logprobs is not None and d.logprobs[0] <= 0.0 and d.top_logprobs == ((),) for d in zero)
    wide = generate_one(engine, prompt(5), max_tokens=3, logprobs=20, temperature=0.8, seed=3)
    assert tokens_of(wide) == tokens_of(zero)
    for z, w in zip(zero, wide):
        assert z.logprobs == pytest.approx(w.logprobs, abs=1e-6)
        listed = dict(w.top_logprobs[0])
        if w.token_ids[0] in listed:  # the raw (untempered) logprob is reported
            assert listed[w.token_ids[0]] == pytest.approx(w.logprobs[0], abs=1e-6)
        assert w.logprobs[0] <= w.top_logprobs[0][0][1] + 1e-6
    none = generate_one(engine, prompt(5), max_tokens=2, **GREEDY)
    assert all(d.logprobs is None and d.top_logprobs is None for d in none)


# --- seeded sampling -----------------------------------------------------------------------------


def test_seeded_sampling_is_batch_invariant(engine: LLMEngine) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)
    alone = tokens_of(run(engine, GenerationRequest("s", prompt(6), seeded))["s"])
    again = tokens_of(run(engine, GenerationRequest("s", prompt(6), seeded))["s"])
    assert again == alone
    others = [
        GenerationRequest("o1", tuple(b"a much longer prompt that needs two blocks of KV"),
                          SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)),
        GenerationRequest("o2", (7,), SamplingParams(max_tokens=5, **GREEDY)),
        GenerationRequest(
            "o3", prompt(8), SamplingParams(max_tokens=12, temperature=0.8, seed=8, ignore_eos=True)
        ),
    ]
    batched = run(engine, others[0], GenerationRequest("s", prompt(6), seeded), *others[1:])
    assert tokens_of(batched["s"]) == alone
    other_seed = run(engine, GenerationRequest("s", prompt(6), SamplingParams(
        max_tokens=12, temperature=0.8, seed=8, ignore_eos=True)))["s"]
    assert tokens_of(other_seed) != alone  # the seed, not luck, fixes the tokens


def test_preemption_under_a_small_pool_keeps_greedy_outputs(tiny_dir: Path, llm: LLM) -> None:
    prompts = [list(prompt(i)) * 3 for i in range(4)]  # 27..30 tokens: 2 blocks each, 4 with output
    params = SamplingParams(max_tokens=30, **GREEDY)
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    small = LLM(make_config(tiny_dir, num_blocks=10))
    outs = small.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert small.engine.num_preemptions > 0
    assert small.engine.block_manager.num_free_blocks == 10 and not small.engine.requests



def test_first_delta_reports_queue_time_and_prefill_chunks(tiny_dir: Path) -> None:
    engine = LLMEngine(make_config(tiny_dir, max_num_batched_tokens=16, max_num_seqs=4))
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    # 40 prompt tokens under a 16-token budget: chunks of 16, 16, 8; the second request waits behind it
    out = run(engine, GenerationRequest("a", tuple(range(40)), params), GenerationRequest("b", (1, 2, 3), params))
    first, second = out["a"]
    assert first.num_prefill_chunks == 3 and first.queue_time_s is not None and first.queue_time_s >= 0
    assert second.queue_time_s is None  # reported once, on the first token
    assert out["b"][0].num_prefill_chunks == 1
    assert out["b"][0].queue_time_s >= first.queue_time_s  # admitted after "a" had the budget


def test_per_request_prefill_chunk_cap(tiny_dir: Path, llm: LLM) -> None:
    engine = LLMEngine(make_config(tiny_dir, max_num_batched_tokens=64, max_num_seqs=4))
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
    capped = run(engine, GenerationRequest("a", tuple(range(40)), params, max_prefill_chunk=16))["a"]
    assert capped[0].num_prefill_chunks == 3  # 16 + 16 + 8 under a 64-token budget
    whole = run(engine, GenerationRequest("b", tuple(range(40, 80)), params))["b"]
    assert whole[0].num_prefill_chunks == 1
    # the cap changes scheduling only, never the tokens
    expected = llm.generate([list(range(40))], params)[0].token_ids
    assert [d.token_ids[0] for d in capped] == expected
    with pytest.raises(ValueError, match="max_prefill_chunk"):
        GenerationRequest("c", (1,), params, max_prefill_chunk=0)
