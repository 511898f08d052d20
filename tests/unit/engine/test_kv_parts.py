"""KV in parts while a prefill-only prompt is computed: each part leased apart from the sequence, the
final handoff naming the blocks that went ahead, and the copies adding up to the plain greedy stream."""

from __future__ import annotations

from pathlib import Path

import pytest
from pdserve.engine import GenerationRequest, LLMEngine, TokenDelta
from pdserve.engine.kv_parts import part_tokens

from tests.unit.engine.test_split_phase import (
    BLOCK_SIZE,
    adopt,
    assert_all_free,
    greedy,
    make_engine,
    params,
    prompt_of,
    run,
    tokens_of,
)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> LLMEngine:
    return make_engine(tiny_dir)


@pytest.fixture(scope="module")
def engine_b(tiny_dir: Path) -> LLMEngine:
    return make_engine(tiny_dir, num_blocks=24)


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> LLMEngine:
    return make_engine(tiny_dir, enable_prefix_caching=False)


@pytest.fixture(autouse=True)
def _idle_after(engine: LLMEngine, engine_b: LLMEngine, reference: LLMEngine):
    yield
    assert_all_free(engine, engine_b, reference)


def prefill_in_parts(engine: LLMEngine, prompt, part: int, request_id: str = "pre") -> list[TokenDelta]:
    request = GenerationRequest(request_id, prompt, params(), prefill_only=True, kv_part_tokens=part)
    return run(engine, request)[request_id]


def test_part_size_is_whole_blocks() -> None:
    assert part_tokens(1, 16) == 16 and part_tokens(16, 16) == 16 and part_tokens(17, 16) == 32


def test_kv_part_tokens_needs_prefill_only() -> None:
    with pytest.raises(ValueError, match="prefill-only"):
        GenerationRequest("x", (1, 2), params(), kv_part_tokens=16)
    with pytest.raises(ValueError, match="at least 1"):
        GenerationRequest("x", (1, 2), params(), prefill_only=True, kv_part_tokens=0)


@pytest.mark.parametrize(("length", "part"), [(100, 32), (100, 20), (64, 32), (30, 32)])
def test_parts_then_tail_reassemble_the_prompt(engine, engine_b, reference, length: int, part: int) -> None:
    prompt = prompt_of(length, salt=length + part)
    plain = tokens_of(greedy(reference, prompt))
    deltas = prefill_in_parts(engine, prompt, part)
    parts, final = [d.kv_part for d in deltas[:-1]], deltas[-1]
    step = part_tokens(part, BLOCK_SIZE) // BLOCK_SIZE
    assert all(d.token_ids == () and not d.finished for d in deltas[:-1])
    # every part is a whole part, in order, and the tail is whatever the last chunk left
    assert [p.first_block for p in parts] == [i * step for i in range(len(parts))]
    assert all(len(p.block_ids) == step and p.num_tokens == step * BLOCK_SIZE for p in parts)
    handoff = final.kv_handoff
    assert handoff.num_parted_blocks == len(parts) * step < len(handoff.block_ids)
    assert len(parts) == (length - 1) // (step * BLOCK_SIZE)
    # the final lease covers the whole prompt; each part's blocks are the same blocks, leased again
    assert handoff.block_ids[: handoff.num_parted_blocks] == tuple(b for p in parts for b in p.block_ids)
    (first,) = final.token_ids
    lease = engine_b.reserve_kv(handoff.num_tokens)
    for index, (a_block, b_block) in enumerate(zip(handoff.block_ids, lease.block_ids)):
        engine_b.runner.kv_pool[b_block].copy_(engine.runner.kv_pool[a_block])
        owner = next((p for p in parts if p.first_block <= index < p.first_block + step), None)
        if owner is not None and index == owner.first_block + step - 1:
            assert engine.release_lease(owner.lease_id)  # pulled: the part's lease ends, the final one holds on
    assert engine.release_lease(handoff.lease_id)
    rest = run(engine_b, adopt(engine_b, prompt, lease.lease_id, first))["dec"]
    assert [first, *tokens_of(rest)] == plain


def test_an_abort_mid_prompt_leaves_the_parts_readable_until_released(engine: LLMEngine) -> None:
    prompt = prompt_of(120, salt=7)
    engine.add_request(GenerationRequest("pre", prompt, params(), prefill_only=True, kv_part_tokens=32))
    parts = []
    while len(parts) < 2:
        parts += [d.kv_part for d in engine.step() if d.kv_part is not None]
    snapshot = [engine.runner.kv_pool[b].clone() for b in parts[0].block_ids]
    assert engine.abort("pre")
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks  # the parts still hold theirs
    engine.add_request(GenerationRequest("other", prompt_of(150, salt=8), params(max_tokens=2)))
    while engine.has_unfinished():
        engine.step()
    assert all(engine.runner.kv_pool[b].equal(s) for b, s in zip(parts[0].block_ids, snapshot))
    for part in parts:
        assert engine.release_lease(part.lease_id)


def test_a_prefix_cache_hit_leaves_as_a_part_before_the_rest_is_computed(engine, engine_b, reference) -> None:
    prompt = prompt_of(100, salt=41)
    warm = prefill_in_parts(engine, prompt, 32, request_id="warm")  # fills the prefix cache
    for delta in warm:
        engine.release_lease((delta.kv_part or delta.kv_handoff).lease_id)
    plain = tokens_of(greedy(reference, prompt))
    engine.add_request(GenerationRequest("hit", prompt, params(), prefill_only=True, kv_part_tokens=32))
    first_step = engine.step()
    # the 6 cached full blocks go out with the first step, as one part, beside the step that computes the rest
    (part,) = [d.kv_part for d in first_step if d.kv_part is not None]
    assert part.first_block == 0 and len(part.block_ids) == 6
    deltas = list(first_step)
    while engine.has_unfinished():
        deltas += engine.step()
    final = deltas[-1]
    assert final.num_cached_tokens == 96 and final.kv_handoff.num_parted_blocks == 6
    lease = engine_b.reserve_kv(final.kv_handoff.num_tokens)
    for a_block, b_block in zip(final.kv_handoff.block_ids, lease.block_ids):
        engine_b.runner.kv_pool[b_block].copy_(engine.runner.kv_pool[a_block])
    assert engine.release_lease(part.lease_id) and engine.release_lease(final.kv_handoff.lease_id)
    rest = run(engine_b, adopt(engine_b, prompt, lease.lease_id, final.token_ids[0]))["dec"]
    assert [final.token_ids[0], *tokens_of(rest)] == plain
