"""Split-phase serving on one or two engines: prefill-only handoff under a lease, KV copy, adoption."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import AsyncLLMEngine, GenerationRequest, KVHandoff, LLMEngine, TokenDelta
from pdserve.models.tiny import TINY_CONFIG, ensure_tiny_checkpoint
from pdserve.sampling_params import SamplingParams

BLOCK_SIZE = 16
MAX_TOKENS = 10
TTL_S = 30.0


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny-split"))


def make_engine(tiny_dir: Path, num_blocks: int = 40, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(tiny_dir), device="cpu", dtype="float32", lease_ttl_s=overrides.pop("lease_ttl_s", TTL_S),
        cache=CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, **overrides),
    ))


def params(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt_of(length: int, salt: int = 0) -> tuple[int, ...]:
    return tuple((37 * i + 11 * salt + 5) % 250 for i in range(length))


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
    return deltas


def tokens_of(stream: list[TokenDelta]) -> list[int]:
    return [t for d in stream for t in d.token_ids]


def greedy(engine: LLMEngine, prompt: tuple[int, ...], request_id: str = "plain") -> list[TokenDelta]:
    """A plain (not split) greedy generate of MAX_TOKENS tokens."""
    return run(engine, GenerationRequest(request_id, prompt, params()))[request_id]


def prefill(engine: LLMEngine, prompt, request_id: str = "pre") -> tuple[int, KVHandoff, TokenDelta]:
    (delta,) = run(engine, GenerationRequest(request_id, prompt, params(), prefill_only=True))[request_id]
    assert delta.finished and delta.finish_reason is None and delta.kv_handoff is not None
    (first,) = delta.token_ids
    return first, delta.kv_handoff, delta


def adopt(engine: LLMEngine, prompt, lease_id: str, first: int, request_id: str = "dec") -> GenerationRequest:
    return GenerationRequest(request_id, prompt, params(), adopt_lease_id=lease_id, first_token_id=first)


def assert_all_free(*engines: LLMEngine) -> None:
    for engine in engines:
        assert not engine.requests and not engine.leases.leases
        assert engine.scheduler.num_waiting == engine.scheduler.num_running == 0
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> LLMEngine:
    return make_engine(tiny_dir)


@pytest.fixture(scope="module")
def engine_b(tiny_dir: Path) -> LLMEngine:
    return make_engine(tiny_dir, num_blocks=24)


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> LLMEngine:
    # Plain greedy outputs come from a third engine, so the engines under test see each prompt only
    # through the path under test (no prefix hits from a reference run).
    return make_engine(tiny_dir, enable_prefix_caching=False)


@pytest.fixture(autouse=True)
def _idle_after(engine: LLMEngine, engine_b: LLMEngine, reference: LLMEngine):
    # Module-scoped engines: every test must leave them idle, with no lease and the whole pool free.
    yield
    assert_all_free(engine, engine_b, reference)


@pytest.mark.parametrize("length", [21, 32, 1])
def test_prefill_then_adopt_on_the_same_engine(engine: LLMEngine, reference: LLMEngine, length: int) -> None:
    prompt = prompt_of(length, salt=length)
    plain = tokens_of(greedy(reference, prompt))
    free = engine.block_manager.num_free_blocks
    first, handoff, delta = prefill(engine, prompt)
    assert delta.num_cached_tokens == 0
    assert first == plain[0]
    assert handoff.num_tokens == length and len(handoff.block_ids) == -(-length // BLOCK_SIZE)
    assert handoff.lease_id in engine.leases.leases and not engine.requests
    assert len(handoff.block_hashes) == length // BLOCK_SIZE
    assert delta.num_prompt_tokens == length and delta.num_output_tokens == 1
    assert engine.block_manager.num_free_blocks == free - len(handoff.block_ids)
    assert engine.stats().num_leased_blocks == len(handoff.block_ids)
    rest = run(engine, adopt(engine, prompt, handoff.lease_id, first))["dec"]
    assert not engine.leases.leases  # adoption consumed the lease
    assert [first, *tokens_of(rest)] == plain and len(plain) == MAX_TOKENS
    assert rest[-1].finish_reason == "length" and rest[-1].num_output_tokens == MAX_TOKENS


def first_token_case(reference: LLMEngine, predicate) -> tuple[tuple[int, ...], int]:
    """A prompt whose greedy first token satisfies `predicate`."""
    for salt in range(100, 400):
        prompt = prompt_of(20, salt=salt)
        (delta,) = run(reference, GenerationRequest("probe", prompt, params(max_tokens=1)))["probe"]
        if predicate(delta.token_ids[0]):
            return prompt, delta.token_ids[0]
    pytest.fail("no probe prompt has a first token of the wanted kind")


@pytest.mark.parametrize("held", ["utf8-lead-byte", "stop-prefix"])
def test_text_held_at_the_handoff_is_streamed_once(engine: LLMEngine, reference: LLMEngine, held) -> None:
    # The first token's text may be held back (half a character, or the start of a stop string):
    # prefill text + adopted text must equal the plain stream's text, nothing emitted twice.
    if held == "utf8-lead-byte":
        prompt, first = first_token_case(reference, lambda t: 0xC2 <= t <= 0xF4)
        sampling = params()
    else:
        prompt, first = first_token_case(reference, lambda t: t < 128 and chr(t).isalnum())
        stop = (chr(first) + "\x00",)
        sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=stop)
    plain = run(reference, GenerationRequest("plain", prompt, sampling))["plain"]
    (pre,) = run(engine, GenerationRequest("pre", prompt, sampling, prefill_only=True))["pre"]
    assert pre.token_ids == (first,) and pre.text == ""  # all of it is held
    adopted = GenerationRequest(
        "dec", prompt, sampling, adopt_lease_id=pre.kv_handoff.lease_id, first_token_id=first
    )
    rest = run(engine, adopted)["dec"]
    assert [first, *tokens_of(rest)] == tokens_of(plain)
    assert pre.text + "".join(d.text for d in rest) == "".join(d.text for d in plain)


def test_prefill_on_one_engine_decode_on_another(engine: LLMEngine, engine_b: LLMEngine, reference) -> None:
    prompt = prompt_of(40, salt=1)
    plain = tokens_of(greedy(reference, prompt))
    placeholder = engine_b.reserve_kv(3 * BLOCK_SIZE)  # B's block ids differ from A's
    first, handoff, _ = prefill(engine, prompt)
    lease = engine_b.reserve_kv(handoff.num_tokens)
    assert lease.num_tokens == handoff.num_tokens and len(lease.block_ids) == len(handoff.block_ids)
    assert set(lease.block_ids).isdisjoint(placeholder.block_ids)
    for a_block, b_block in zip(handoff.block_ids, lease.block_ids):
        engine_b.runner.kv_pool[b_block].copy_(engine.runner.kv_pool[a_block])
    assert engine.release_lease(handoff.lease_id)
    assert not engine.release_lease(handoff.lease_id)
    rest = run(engine_b, adopt(engine_b, prompt, lease.lease_id, first))["dec"]
    assert [first, *tokens_of(rest)] == plain
    assert engine_b.release_lease(placeholder.lease_id)


def test_adopting_uncopied_kv_changes_the_output(engine: LLMEngine, engine_b: LLMEngine, reference) -> None:
    # Control for the test above: the KV bytes, not the first token alone, decide the continuation.
    prompt = prompt_of(40, salt=2)
    plain = tokens_of(greedy(reference, prompt))
    first, handoff, _ = prefill(engine, prompt)
    lease = engine_b.reserve_kv(handoff.num_tokens)
    for b_block in lease.block_ids:
        engine_b.runner.kv_pool[b_block].normal_(generator=torch.Generator().manual_seed(b_block))
    assert engine.release_lease(handoff.lease_id)
    rest = run(engine_b, adopt(engine_b, prompt, lease.lease_id, first))["dec"]
    assert [first, *tokens_of(rest)] != plain


def test_unadopted_handoff_expires(engine: LLMEngine) -> None:
    prompt = prompt_of(30, salt=3)
    free = engine.block_manager.num_free_blocks
    first, handoff, _ = prefill(engine, prompt)
    assert engine.block_manager.num_free_blocks == free - 2
    assert engine.expire_leases(now=time.monotonic() + TTL_S / 2) == 0  # not before its time
    assert engine.expire_leases(now=time.monotonic() + TTL_S + 1) == 1
    assert engine.stats().num_expired_leases == 1  # expiries are counted
    assert engine.block_manager.num_free_blocks == free
    assert not engine.release_lease(handoff.lease_id)  # already gone
    with pytest.raises(KeyError):
        engine.add_request(adopt(engine, prompt, handoff.lease_id, first))
    assert not engine.requests and engine.block_manager.num_free_blocks == free


def test_zero_ttl_lease_is_released_by_the_next_step(tiny_dir: Path) -> None:
    engine = make_engine(tiny_dir, num_blocks=8, lease_ttl_s=0.0)
    _, handoff, _ = prefill(engine, prompt_of(20, salt=4))
    lease = engine.reserve_kv(17)
    assert engine.stats().num_leased_blocks == len(handoff.block_ids) + len(lease.block_ids) == 4
    assert engine.step() == []
    assert_all_free(engine)


def test_release_twice_and_bad_adoptions_leak_nothing(engine: LLMEngine) -> None:
    prompt = prompt_of(25, salt=5)
    free = engine.block_manager.num_free_blocks
    first, handoff, _ = prefill(engine, prompt)
    held = engine.block_manager.num_free_blocks
    with pytest.raises(KeyError):
        engine.add_request(adopt(engine, prompt, "no-such-lease", first))
    with pytest.raises(ValueError):  # out-of-vocab first token: rejected before the lease is touched
        engine.add_request(adopt(engine, prompt, handoff.lease_id, TINY_CONFIG["vocab_size"]))
    assert handoff.lease_id in engine.leases.leases and engine.block_manager.num_free_blocks == held
    with pytest.raises(ValueError):
        GenerationRequest("x", prompt, adopt_lease_id=handoff.lease_id)  # first token missing
    with pytest.raises(ValueError):
        GenerationRequest(
            "x", prompt, prefill_only=True, adopt_lease_id=handoff.lease_id, first_token_id=first
        )
    assert not engine.requests
    assert engine.release_lease(handoff.lease_id)
    assert not engine.release_lease(handoff.lease_id)
    assert engine.block_manager.num_free_blocks == free
    # a lease that does not cover the prompt is consumed and its blocks come back
    first, handoff, _ = prefill(engine, prompt)
    with pytest.raises(ValueError):
        engine.add_request(adopt(engine, prompt + (1, 2), handoff.lease_id, first))
    assert not engine.requests and not engine.leases.leases
    assert engine.block_manager.num_free_blocks == free


def test_first_token_that_finishes_skips_the_handoff(engine: LLMEngine, reference: LLMEngine) -> None:
    prompt = prompt_of(20, salt=6)
    first = tokens_of(greedy(reference, prompt))[0]
    one = run(engine, GenerationRequest("one", prompt, params(max_tokens=1), prefill_only=True))["one"]
    assert one[-1].finish_reason == "length" and one[-1].kv_handoff is None
    stop = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(first,))
    stopped = run(engine, GenerationRequest("stop", prompt, stop, prefill_only=True))["stop"]
    assert stopped[-1].finish_reason == "stop" and stopped[-1].kv_handoff is None


def test_released_handoff_leaves_a_prefix_cache_hit(engine: LLMEngine, reference: LLMEngine) -> None:
    prompt = prompt_of(50, salt=7)
    plain = tokens_of(greedy(reference, prompt))
    first, handoff, delta = prefill(engine, prompt)
    assert delta.num_cached_tokens == 0
    assert engine.release_lease(handoff.lease_id)
    warm = greedy(engine, prompt, "warm")
    assert warm[-1].num_cached_tokens == 3 * BLOCK_SIZE  # every full block of the prompt but the last token's
    assert tokens_of(warm) == plain and first == plain[0]
    assert engine.stats().prefix_hit_tokens >= 3 * BLOCK_SIZE


def test_two_handoffs_of_one_prompt_share_cached_blocks(engine: LLMEngine, reference: LLMEngine) -> None:
    prompt = prompt_of(40, salt=10)
    plain = tokens_of(greedy(reference, prompt))
    free = engine.block_manager.num_free_blocks
    first_a, handoff_a, delta_a = prefill(engine, prompt, "pre-a")
    first_b, handoff_b, delta_b = prefill(engine, prompt, "pre-b")  # hits the blocks lease A holds
    assert first_a == first_b == plain[0]
    assert delta_a.num_cached_tokens == 0 and delta_b.num_cached_tokens == 2 * BLOCK_SIZE
    assert handoff_a.block_ids[:2] == handoff_b.block_ids[:2]  # full blocks shared, the partial one not
    assert handoff_a.block_ids[2] != handoff_b.block_ids[2]
    assert engine.block_manager.num_free_blocks == free - 4
    assert engine.release_lease(handoff_a.lease_id)
    assert engine.block_manager.num_free_blocks == free - 3  # shared blocks stay with lease B
    rest = run(engine, adopt(engine, prompt, handoff_b.lease_id, first_b))["dec"]
    assert [first_b, *tokens_of(rest)] == plain


def test_prefix_cache_hit_on_the_adopting_engine(engine: LLMEngine, engine_b: LLMEngine, reference) -> None:
    # Adopted KV is registered in B's prefix cache, so a later request there reuses it.
    prompt = prompt_of(36, salt=8)
    plain = tokens_of(greedy(reference, prompt))
    first, handoff, _ = prefill(engine, prompt)
    lease = engine_b.reserve_kv(handoff.num_tokens)
    for a_block, b_block in zip(handoff.block_ids, lease.block_ids):
        engine_b.runner.kv_pool[b_block].copy_(engine.runner.kv_pool[a_block])
    assert engine.release_lease(handoff.lease_id)
    run(engine_b, adopt(engine_b, prompt, lease.lease_id, first))
    again = greedy(engine_b, prompt, "again")
    assert again[-1].num_cached_tokens == 2 * BLOCK_SIZE
    assert tokens_of(again) == plain


def test_split_phase_through_the_async_engine(tiny_dir: Path) -> None:
    async def main() -> None:
        prefill_engine = AsyncLLMEngine(make_engine(tiny_dir, num_blocks=16))
        decode_engine = AsyncLLMEngine(make_engine(tiny_dir, num_blocks=16))
        try:
            prompt = prompt_of(33, salt=9)
            plain_request = GenerationRequest("p", prompt, params())
            plain = [t async for d in decode_engine.generate(plain_request) for t in d.token_ids]
            prefill_request = GenerationRequest("r", prompt, params(), prefill_only=True)
            pre = [d async for d in prefill_engine.generate(prefill_request)]
            (delta,) = pre
            handoff = delta.kv_handoff
            lease = await decode_engine.reserve_kv(handoff.num_tokens)
            for a_block, b_block in zip(handoff.block_ids, lease.block_ids):
                source = prefill_engine.engine.runner.kv_pool[a_block]
                decode_engine.engine.runner.kv_pool[b_block].copy_(source)
            assert await prefill_engine.release_lease(handoff.lease_id)
            request = GenerationRequest(
                "r", prompt, params(), adopt_lease_id=lease.lease_id, first_token_id=delta.token_ids[0]
            )
            rest = [t async for d in decode_engine.generate(request) for t in d.token_ids]
            assert [*delta.token_ids, *rest] == plain
            for e in (prefill_engine, decode_engine):
                assert e.stats().num_free_blocks == 16 and e.stats().num_leased_blocks == 0
        finally:
            await prefill_engine.close()
            await decode_engine.close()
        assert_all_free(prefill_engine.engine, decode_engine.engine)

    asyncio.run(main())
