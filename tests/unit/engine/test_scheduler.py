"""The scheduler driven without a model: a step advances the KV progress of what was scheduled."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.config import SchedulerConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.sampling_params import SamplingParams

BS = 4
FIRST_OUTPUT = 1000


def make_scheduler(
    num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 32,
    chunked: bool = True, caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, BlockManager(num_blocks, BS, enable_prefix_caching=caching))


def make_seq(
    request_id: str, prompt_len: int, max_tokens: int = 4, priority: int = 0, base: int = 0,
) -> Sequence:
    tokens = [base + i % 7 for i in range(prompt_len)]
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens), BS, priority=priority)


def expected_outputs(seq: Sequence) -> list[int]:
    return [FIRST_OUTPUT + i for i in range(seq.params.max_tokens)]


def check_batch(
    sched: Scheduler, batch: ScheduledBatch, decoding_before: list[Sequence], waiting_before: list[Sequence],
) -> None:
    config, bm = sched.config, sched.block_manager
    items = batch.decodes + [s for s, _ in batch.prefills]
    assert len(items) == len({id(s) for s in items}), "a sequence scheduled twice"
    assert len(items) <= config.max_num_seqs and sched.num_running <= config.max_num_seqs
    oversized_alone = (
        not config.enable_chunked_prefill and not batch.decodes and len(batch.prefills) == 1
        and batch.prefills[0][1] > config.max_num_batched_tokens
    )
    assert batch.num_tokens <= config.max_num_batched_tokens or oversized_alone
    for seq in items:
        assert seq.status == SequenceStatus.RUNNING and seq in sched.running
    for seq in batch.decodes:
        assert seq.is_decoding
        assert len(seq.block_table) >= seq.blocks_needed(len(seq))
    for seq, num_new in batch.prefills:
        assert 1 <= num_new <= seq.num_uncomputed_tokens
        if not config.enable_chunked_prefill:
            assert num_new == seq.num_uncomputed_tokens, "prompt split with chunking off"
        assert len(seq.block_table) >= seq.blocks_needed(seq.num_computed_tokens + num_new)
    # decodes go first: every sequence that was decoding is decoded now unless it was preempted
    for seq in decoding_before:
        assert seq in batch.decodes or seq in batch.preempted
    admitted = [s for s, _ in batch.prefills if any(s is w for w in waiting_before)]
    if admitted:
        # a sequence is admitted only when its whole remaining prompt fits the pool
        last = admitted[-1]
        assert bm.num_blocks_to_grow(last, len(last)) <= bm.num_free_blocks
    for seq in batch.preempted:
        if seq.status == SequenceStatus.WAITING:
            assert seq in sched.waiting and seq.num_computed_tokens == 0
    for seq in sched.waiting:
        assert seq.status == SequenceStatus.WAITING and seq.block_table == []
    check_pool(sched)


def check_pool(sched: Scheduler) -> None:
    bm = sched.block_manager
    held = Counter(b for s in sched.running for b in s.block_table)
    for block in bm.blocks:
        assert block.ref_count == held[block.block_id]
    assert bm.num_free_blocks + len(held) == bm.num_blocks


def advance(sched: Scheduler, seq: Sequence, num_new: int) -> None:
    seq.num_computed_tokens += num_new
    sched.block_manager.register_full_blocks(seq)
    if seq.num_computed_tokens == len(seq):
        seq.token_ids.append(FIRST_OUTPUT + seq.num_output_tokens)
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")


def step(sched: Scheduler, abort: list[Sequence] = ()) -> ScheduledBatch:
    decoding_before = [s for s in sched.running if s.is_decoding]
    waiting_before = list(sched.waiting)
    batch = sched.schedule()
    check_batch(sched, batch, decoding_before, waiting_before)
    for seq in abort:  # aborted between scheduling and running
        if not seq.is_finished:
            sched.finish(seq, "abort")
    for seq in batch.decodes:
        if not seq.is_finished:
            advance(sched, seq, 1)
    for seq, num_new in batch.prefills:
        if not seq.is_finished:
            advance(sched, seq, num_new)
    return batch


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[ScheduledBatch]:
    batches = []
    while sched.has_work:
        assert len(batches) < max_steps, "requests did not finish"
        batch = step(sched)
        assert not batch.is_empty, "no progress while work is queued"
        batches.append(batch)
    return batches


def test_rejects_budget_smaller_than_max_num_seqs():
    with pytest.raises(ValueError):
        make_scheduler(max_num_seqs=8, max_num_batched_tokens=4)


def test_decodes_first_then_prefill_chunk_takes_leftover_budget():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16)
    short = [make_seq(f"s{i}", 4, max_tokens=10) for i in range(3)]
    for seq in short:
        sched.add(seq)
    batch = step(sched)
    assert [(s.request_id, n) for s, n in batch.prefills] == [("s0", 4), ("s1", 4), ("s2", 4)]
    long = make_seq("long", 40)
    sched.add(long)
    batch = step(sched)
    assert batch.decodes == short
    assert batch.prefills == [(long, 13)]
    batch = step(sched)
    assert batch.decodes == short and batch.prefills == [(long, 13)]


def test_decodes_are_not_displaced_by_a_tight_budget():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=4)
    for i in range(3):
        sched.add(make_seq(f"s{i}", 1, max_tokens=20))
    step(sched)
    sched.add(make_seq("long", 12))
    for _ in range(12):
        batch = step(sched)
        assert len(batch.decodes) == 3 and batch.num_tokens == 4
        assert [n for _, n in batch.prefills] == [1]


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    sched = make_scheduler(max_num_batched_tokens=16)
    seq = make_seq("a", 50, max_tokens=3)
    sched.add(seq)
    chunks = []
    while seq.num_output_tokens == 0:
        batch = step(sched)
        chunks.extend(n for _, n in batch.prefills)
    assert chunks == [16, 16, 16, 2]
    assert step(sched).decodes == [seq]
    assert seq.output_token_ids == expected_outputs(seq)[:2]


def test_without_chunking_prompts_are_never_split():
    sched = make_scheduler(max_num_batched_tokens=16, chunked=False)
    seqs = [make_seq(f"s{i}", 10, max_tokens=2, base=10 * i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    batch = step(sched)
    assert batch.prefills == [(seqs[0], 10)]  # the second would be split by the 6 tokens left
    batch = step(sched)
    assert batch.decodes == [seqs[0]] and batch.prefills == [(seqs[1], 10)]
    run_to_completion(sched)
    assert all(s.output_token_ids == expected_outputs(s) for s in seqs)


def test_without_chunking_a_prompt_waits_for_room_left_by_decodes():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16, chunked=False)
    decoding = make_seq("d", 3, max_tokens=3)
    sched.add(decoding)
    step(sched)
    full = make_seq("full", 16, max_tokens=1, base=50)
    sched.add(full)
    # 16 tokens fit an empty step but not beside a decode: no overshoot, and no split
    assert step(sched).prefills == []
    assert step(sched).prefills == []
    assert decoding.is_finished
    assert step(sched).prefills == [(full, 16)]


def test_without_chunking_an_oversized_prompt_runs_alone():
    sched = make_scheduler(max_num_seqs=4, max_num_batched_tokens=16, chunked=False)
    decoding = make_seq("d", 3, max_tokens=3)
    sched.add(decoding)
    step(sched)
    big = make_seq("big", 40, max_tokens=2, base=50)
    after = make_seq("after", 2, max_tokens=1, base=90)
    sched.add(big)
    sched.add(after)
    while not decoding.is_finished:
        batch = step(sched)
        assert batch.prefills == []  # FIFO: "after" does not jump the queue either
    batch = step(sched)
    assert batch.prefills == [(big, 40)] and batch.decodes == []
    run_to_completion(sched)
    assert big.output_token_ids == expected_outputs(big)


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    seqs = [make_seq(f"s{i}", 5, max_tokens=3, base=i) for i in range(10)]
    for seq in seqs:
        sched.add(seq)
    peak = 0
    for batch in run_to_completion(sched):
        peak = max(peak, len(batch.decodes) + len(batch.prefills))
    assert peak == 3
    assert all(s.output_token_ids == expected_outputs(s) for s in seqs)


def test_priority_orders_admission_fifo_within_a_class():
    sched = make_scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    priorities = [2, 0, 1, 0, 2, 1, 0]
    seqs = [make_seq(f"s{i}", 3, max_tokens=1, priority=p, base=i) for i, p in enumerate(priorities)]
    for seq in seqs:
        sched.add(seq)
    order = [s.request_id for s in sched.waiting]
    assert order == ["s1", "s3", "s6", "s2", "s5", "s0", "s4"]
    admitted = [s.request_id for batch in run_to_completion(sched) for s, _ in batch.prefills]
    assert admitted == order


def test_preemption_by_recompute_keeps_generated_tokens():
    sched = make_scheduler(num_blocks=6, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [make_seq(f"s{i}", 6, max_tokens=10, base=10 * i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    preempted = []
    recomputed = []
    while sched.has_work:
        assert len(preempted) < 100
        batch = step(sched)
        for victim in batch.preempted:
            assert victim.status == SequenceStatus.WAITING and victim.block_table == []
            assert victim in list(sched.waiting)[: len(batch.preempted)]  # back at the front
            preempted.append((victim, victim.num_output_tokens))
        recomputed += [(s, n) for s, n in batch.prefills if s.num_output_tokens > 0]
    assert preempted
    assert {s.request_id for s, _ in preempted} <= {"s1", "s2"}  # the oldest is never the victim
    assert any(out > 0 for _, out in preempted)
    assert recomputed  # a preempted sequence prefills its prompt and generated tokens again
    for seq in seqs:
        assert seq.output_token_ids == expected_outputs(seq)
        assert seq.finish_reason == "length"
    assert sum(s.num_preemptions for s in seqs) == len(preempted)
    assert sched.block_manager.num_free_blocks == 6


def test_queued_prefill_tokens():
    sched = make_scheduler(max_num_batched_tokens=8)
    a, b = make_seq("a", 20), make_seq("b", 5, base=30)
    sched.add(a)
    sched.add(b)
    assert sched.queued_prefill_tokens() == 25
    step(sched)
    assert sched.queued_prefill_tokens() == 17


def test_abort_waiting_and_running_frees_blocks():
    sched = make_scheduler(num_blocks=16, max_num_batched_tokens=8)
    a, b = make_seq("a", 12), make_seq("b", 12, base=40)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING
    sched.finish(b, "abort")
    sched.finish(a, "abort")
    assert (a.finish_reason, b.finish_reason) == ("abort", "abort")
    assert a.block_table == [] and not sched.has_work
    assert sched.block_manager.num_free_blocks == 16


# --- random workloads ------------------------------------------------------------------------------

MAX_ARRIVAL = 12
request = st.tuples(
    st.integers(1, 40),  # prompt length
    st.integers(1, 12),  # max tokens
    st.integers(0, MAX_ARRIVAL),  # arrival step
    st.integers(0, 2),  # priority
    st.integers(0, 2),  # which shared prefix
)


@st.composite
def workloads(draw):
    max_num_seqs = draw(st.integers(1, 6))
    return dict(
        requests=draw(st.lists(request, min_size=1, max_size=12)),
        max_num_seqs=max_num_seqs,
        budget=draw(st.integers(max_num_seqs, 48)),
        num_blocks=draw(st.integers(1, 24)),
        chunked=draw(st.booleans()),
        caching=draw(st.booleans()),
    )


def build(workload) -> tuple[Scheduler, list[tuple[int, Sequence]]]:
    reqs = workload["requests"]
    # the pool must hold any single request at its longest, or it can never finish
    need = max((p + m - 1 + BS - 1) // BS for p, m, *_ in reqs)
    sched = make_scheduler(
        num_blocks=max(need, workload["num_blocks"]), max_num_seqs=workload["max_num_seqs"],
        max_num_batched_tokens=workload["budget"], chunked=workload["chunked"], caching=workload["caching"],
    )
    arrivals = [
        (at, make_seq(f"r{i}", p, max_tokens=m, priority=prio, base=100 * shared))
        for i, (p, m, at, prio, shared) in enumerate(reqs)
    ]
    return sched, arrivals


def step_bound(arrivals) -> int:
    # generous: every token of every request, recomputed on each preemption, one per step
    total = sum(len(s) + s.params.max_tokens for _, s in arrivals)
    return MAX_ARRIVAL + 1 + total * (len(arrivals) + 1)


def admit(sched: Scheduler, arrivals, t: int) -> None:
    for at, seq in arrivals:
        if at == t:
            sched.add(seq)


@settings(max_examples=100, deadline=None)
@given(workloads())
def test_random_workload_respects_budget_and_every_request_finishes(workload):
    sched, arrivals = build(workload)
    preemptions = 0
    for t in range(step_bound(arrivals)):
        admit(sched, arrivals, t)
        if not sched.has_work:
            if t > MAX_ARRIVAL:
                break
            continue
        batch = step(sched)
        assert not batch.is_empty, "no progress while work is queued"
        preemptions += len(batch.preempted)
    else:
        pytest.fail("a request starved")
    for _, seq in arrivals:
        assert seq.is_finished and seq.finish_reason == "length"
        assert seq.output_token_ids == expected_outputs(seq)
    assert sum(s.num_preemptions for _, s in arrivals) == preemptions
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


abort_event = st.tuples(st.integers(0, 30), st.integers(0, 11), st.booleans())  # step, request, mid-step


@settings(max_examples=100, deadline=None)
@given(workloads(), st.lists(abort_event, max_size=8))
def test_abort_at_any_point_never_leaks_blocks(workload, aborts):
    sched, arrivals = build(workload)
    bm = sched.block_manager
    start = bm.num_free_blocks
    for t in range(step_bound(arrivals)):
        admit(sched, arrivals, t)
        arrived = {id(s) for at, s in arrivals if at <= t}
        now = [(arrivals[i % len(arrivals)][1], mid) for when, i, mid in aborts if when == t]
        now = [(seq, mid) for seq, mid in now if id(seq) in arrived and not seq.is_finished]
        for seq, mid in now:
            if not mid:
                sched.finish(seq, "abort")
        if not sched.has_work and t > MAX_ARRIVAL:
            break
        step(sched, abort=[seq for seq, mid in now if mid])
        check_pool(sched)
    else:
        pytest.fail("a request starved")
    for _, seq in arrivals:
        assert seq.is_finished and seq.block_table == []
        if seq.finish_reason == "length":
            assert seq.output_token_ids == expected_outputs(seq)
    assert bm.num_free_blocks == start == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_stats_count_each_admission_once():
    bm = BlockManager(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    first = Sequence("a", list(range(10, 19)), SamplingParams(max_tokens=1), 4)
    sched.add(first)
    sched.schedule()
    first.num_computed_tokens = len(first)
    bm.register_full_blocks(first)
    sched.finish(first, "stop")
    hog = bm.allocate_blocks(6)  # leave the 2 cached blocks: the prefix matches, the 3rd block cannot be had
    second = Sequence("b", list(range(10, 19)) + [5, 5, 5], SamplingParams(max_tokens=1), 4)
    sched.add(second)
    for _ in range(3):
        assert not sched.schedule().prefills
    assert bm.num_prefix_queried_tokens == len(first)
    bm.release_blocks(hog)
    sched.schedule()
    assert bm.num_prefix_queried_tokens == len(first) + len(second)
    assert bm.num_prefix_hit_tokens == 8
