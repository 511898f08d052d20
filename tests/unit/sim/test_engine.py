"""Closed-form cases of the simulated engines: one request's TTFT and TPOT, chunked prefill, preemption."""

from __future__ import annotations

import dataclasses

import pytest
from pdserve.placement.policy import PlacementConfig
from pdserve.sim import ClusterSpec, EngineSpec, RouterSpec, SimRequest, Simulation
from pdserve.sim.engine import Engine

ROUND_ROBIN = RouterSpec(placement=PlacementConfig(policy="round_robin"))


def one(spec: ClusterSpec, profile, prompt: int, output: int):
    (record,) = Simulation(spec, profile, [SimRequest(0, 0.0, prompt, output)]).run()
    assert record.status == "ok"
    return record


def test_a_disaggregated_requests_first_token_comes_at_the_prefill_end_and_decode_after_the_transfer(profile):
    model, decode = profile.for_role("prefill"), profile.for_role("decode")
    whole = dataclasses.replace(ROUND_ROBIN, kv_part_tokens=None)  # the whole KV moves after the prefill
    spec = ClusterSpec(router=whole)
    record = one(spec, profile, 1000, 8)
    assert record.prefill_replica == "prefill-000" and record.decode_replica == "decode-000"
    assert abs(record.ttft_s - model.prefill_time_s(1000)) < 1e-12
    steps = sum(decode.decode_step_s(1, 1001 + j) for j in range(7))
    assert abs(record.finish_s - record.first_token_s - model.kv_transfer_s(1000, "ucx") - steps) < 1e-12


def test_a_long_prompt_is_prefilled_in_kv_parts_and_only_its_tail_moves_after(profile):
    """The router's kv_part_tokens (256, live default): chunks of one part, parts leave as they are computed;
    the first token comes at the last chunk's end and only the 232 tokens after the third part move then."""
    model, decode = profile.for_role("prefill"), profile.for_role("decode")
    record = one(ClusterSpec(router=ROUND_ROBIN), profile, 1000, 8)
    chunks = [(256, 0), (256, 256), (256, 512), (232, 768)]  # (new tokens, computed before)
    assert abs(record.ttft_s - sum(model.prefill_time_s(n, c) for n, c in chunks)) < 1e-12
    steps = sum(decode.decode_step_s(1, 1001 + j) for j in range(7))
    assert abs(record.finish_s - record.first_token_s - model.kv_transfer_s(232, "ucx") - steps) < 1e-12
    # a prompt of one part or less moves whole, in one chunk
    short = one(ClusterSpec(router=ROUND_ROBIN), profile, 256, 2)
    assert abs(short.ttft_s - model.prefill_time_s(256)) < 1e-12


def test_a_record_counts_its_prompts_chunks_and_cached_tokens(profile):
    """As the live usage and spans report them: 1000 tokens in four 256-token parts; the same prompt sent
    again finds its 62 full blocks (992 tokens) in the prefill replica's cache and computes the rest in one."""
    blocks = tuple(range(1, 63))
    requests = [SimRequest(0, 0.0, 1000, 2, blocks), SimRequest(1, 100.0, 1000, 2, blocks)]
    first, again = sorted(Simulation(ClusterSpec(router=ROUND_ROBIN), profile, requests).run(),
                          key=lambda r: r.request.index)
    assert (first.cached_tokens, first.prefill_chunks) == (0, 4)
    assert (again.cached_tokens, again.prefill_chunks) == (992, 1)


def test_kv_parts_follow_the_routers_rule(profile):
    from pdserve.services.router.config import RouterConfig
    from pdserve.engine.kv_parts import part_tokens as live_part_tokens
    from pdserve.sim.handoff import Handoff, part_tokens, plan_handoff
    from pdserve.sim.scenario import ROUTER_KV_PART_TOKENS

    assert ROUTER_KV_PART_TOKENS == RouterConfig().kv_part_tokens == RouterSpec().kv_part_tokens
    assert all(part_tokens(k, b) == live_part_tokens(k, b) for k in (1, 16, 100, 256, 300)
               for b in (1, 16, 32))
    assert plan_handoff(256, None, True, 1000, 16) == Handoff(256, 256)
    assert plan_handoff(250, 512, True, 1000, 16) == Handoff(256, 256)  # whole blocks
    assert plan_handoff(256, 128, True, 1000, 16) == Handoff(128, 256)  # the placement's cap when smaller
    assert plan_handoff(256, 128, False, 1000, 16) == Handoff(128)  # Serve's choice of decode: no parts
    assert plan_handoff(256, None, True, 256, 16) == Handoff(None)
    assert plan_handoff(None, None, True, 1000, 16) == Handoff(None)
    assert [Handoff(None, 256).tail_tokens(n) for n in (257, 512, 513, 1000)] == [1, 256, 1, 232]
    assert Handoff(None).tail_tokens(1000) == 1000
    with pytest.raises(ValueError, match="kv_part_tokens"):
        RouterSpec(kv_part_tokens=0)


def test_a_single_request_decodes_at_the_batch_1_step_time(profile):
    model = profile.for_role("decode")
    prompt, output = 300, 50
    record = one(ClusterSpec(router=ROUND_ROBIN), profile, prompt, output)
    # after the handoff the sequence holds prompt + 1 tokens; each step computes one more
    steps = [model.decode_step_s(1, prompt + 1 + j) for j in range(output - 1)]
    tail = profile.for_role("prefill").kv_transfer_s(prompt - 256, "ucx")  # after one 256-token KV part
    assert abs(record.tpot_s - (tail + sum(steps)) / (output - 1)) < 1e-12


def test_colocated_ttft_is_the_prefill_alone(profile):
    spec = ClusterSpec(mode="colocated", router=ROUND_ROBIN)
    record = one(spec, profile, 700, 4)
    assert abs(record.ttft_s - profile.for_role("decode").prefill_time_s(700)) < 1e-12


def test_chunked_prefill_splits_by_the_token_budget(profile):
    engine_spec = EngineSpec(max_num_batched_tokens=256)
    spec = ClusterSpec(mode="colocated", decode=engine_spec, router=ROUND_ROBIN)
    record = one(spec, profile, 1000, 1)
    model = profile.for_role("decode")
    chunks = [(256, 0), (256, 256), (256, 512), (232, 768)]  # (new tokens, computed before)
    assert abs(record.ttft_s - sum(model.prefill_time_s(n, c) for n, c in chunks)) < 1e-12

    engine = Engine("e", "colocated", engine_spec, model)
    engine.add(SimRequest(0, 0.0, 1000, 1))
    sizes = []
    while engine.has_work:
        batch = engine.schedule()
        sizes.append([n for _, n, _ in batch.prefills])
        engine.complete(batch, 0.0, 0.0)
    assert sizes == [[256], [256], [256], [232]]


def test_a_placement_chunk_cap_splits_further(profile):
    engine = Engine("e", "colocated", EngineSpec(max_num_batched_tokens=2048), profile.for_role("decode"))
    engine.add(SimRequest(0, 0.0, 1000, 1), max_prefill_chunk=400)
    assert [n for _, n, _ in engine.schedule().prefills] == [400]


def test_without_chunking_a_long_prompt_waits_for_a_whole_step_or_runs_alone(profile):
    engine = Engine("e", "colocated", EngineSpec(max_num_batched_tokens=512, enable_chunked_prefill=False),
                    profile.for_role("decode"))
    engine.add(SimRequest(0, 0.0, 300, 1))
    engine.add(SimRequest(1, 0.0, 300, 1))
    engine.add(SimRequest(2, 0.0, 2000, 1))
    first = engine.schedule()
    assert [n for _, n, _ in first.prefills] == [300]  # the second 300 does not fit the 212 left
    engine.complete(first, 0.0, 0.0)
    second = engine.schedule()
    assert [n for _, n, _ in second.prefills] == [300]
    engine.complete(second, 0.0, 0.0)
    assert [n for _, n, _ in engine.schedule().prefills] == [2000]  # oversized: alone in an empty step


def test_decode_preempts_when_blocks_run_out_and_every_request_finishes(profile):
    tight = EngineSpec(num_blocks=64, block_size=16)  # 1024 tokens of KV for 8 requests of up to 400
    spec = ClusterSpec(prefill=EngineSpec(), decode=tight, router=ROUND_ROBIN)
    requests = [SimRequest(i, 0.001 * i, 200, 200) for i in range(8)]
    sim = Simulation(spec, profile, requests)
    records = sim.run()
    assert sum(r.num_preemptions for r in records) > 0
    assert [r.status for r in records] == ["ok"] * 8
    assert all(r.finish_s is not None and r.finish_s > r.first_token_s for r in records)
    decode = next(r for r in sim.replicas if r.role == "decode").engine
    assert decode.num_free_blocks == tight.num_blocks and not decode.has_work


def test_disaggregated_prefill_blocks_are_freed_after_the_handoff(profile):
    sim = Simulation(ClusterSpec(router=ROUND_ROBIN), profile, [SimRequest(i, 0.0, 500, 3) for i in range(5)])
    sim.run()
    for replica in sim.replicas:
        assert replica.engine.num_free_blocks == replica.engine.spec.num_blocks
        assert replica.num_held == 0 and replica.num_inbound == 0


def _herd(profile, counted: bool) -> list[str | None]:
    """A 3,000-token prompt steps alone on one of two replicas (0.4 s); a short request takes the other; three
    more come 0.1 s apart while the long step runs, each after a poll has dropped the previous one's pending
    placement."""
    from pdserve.placement.policy import PlacementConfig
    from pdserve.sim.cluster import Simulation
    from pdserve.sim.config import ClusterSpec, RouterSpec

    router = RouterSpec(placement=PlacementConfig(policy="least_loaded", stats_poll_period_s=0.1))
    spec = ClusterSpec(mode="colocated", num_decode=2, router=router,
                       decode=EngineSpec(max_num_batched_tokens=4096, stats_count_arriving=counted))
    requests = [SimRequest(0, 0.0, 3000, 20), SimRequest(1, 0.01, 64, 400)]
    requests += [SimRequest(i, 0.02 + 0.1 * (i - 1), 64, 400) for i in range(2, 5)]
    return [r.decode_replica for r in Simulation(spec, profile, requests).run()]


def test_arrivals_the_stats_do_not_show_pile_onto_the_replica_in_a_long_step(profile):
    """Unseen (the live engine before commit 302a9c5), the busy replica shows one request however many wait
    for its step, so it takes the last two of the burst; counted, it shows two and the last goes elsewhere."""
    unseen, counted = _herd(profile, False), _herd(profile, True)
    assert unseen == ["decode-000", "decode-001", "decode-001", "decode-000", "decode-000"]
    assert counted == ["decode-000", "decode-001", "decode-001", "decode-000", "decode-001"]


def test_unseen_arrivals_join_the_stats_when_the_step_ends(profile):
    engine = Engine("r", "colocated", EngineSpec(stats_count_arriving=False), profile.for_role("decode"))
    engine.add(SimRequest(0, 0.0, 100, 4))
    batch = engine.schedule()
    engine.busy_until = 1.0  # the step in flight
    engine.add(SimRequest(1, 0.5, 30, 4))
    mid = engine.snapshot("decode", 0.0, False)
    assert (mid.num_waiting, mid.queued_prefill_tokens) == (0, 100)  # the step's prompt still counts as queued
    engine.busy_until = None
    engine.complete(batch, 1.0, 1.0)
    after = engine.snapshot("decode", 0.0, False)
    assert (after.num_waiting, after.queued_prefill_tokens) == (1, 30)
