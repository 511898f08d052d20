"""Placement policies on synthetic stats: every slo_aware branch, ties, stale stats, full pools, rejection,
and the one path every policy shares (topology, no stats yet, the prompt-length rule, chunk caps)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from pdserve.api.contract import Priority
from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel, TransferModel
from pdserve.placement.policy import (
    POLICIES, Placement, PlacementConfig, PlacementRequest, Rejection, ReplicaSnapshot, create_policy,
)
from pdserve.placement.pending import PendingPlacements
from pdserve.placement.slo_aware import largest_chunk, prefix_hit_tokens

BS = 16
# prefill 10k tok/s + 10 ms a step; decode 20 ms + 1 ms a sequence + 1 us a context token
MODEL = LatencyModel(
    PrefillModel(a=0.01, b=1e-4, c=0.0), DecodeModel(a=0.02, b=1e-3, c=1e-6), kv_bytes_per_token=1000,
    transfers={"redis": TransferModel(latency_s=0.005, bandwidth_bytes_s=1e8)},
)
PROFILE = LatencyProfile({"default": MODEL})


def snap(replica_id: str, role: str = "decode", **kw) -> ReplicaSnapshot:
    fields = {"age_s": 0.1, "num_running": 0, "num_waiting": 0, "queued_prefill_tokens": 0,
              "num_free_blocks": 1000, "num_total_blocks": 1000, "block_size": BS}
    return ReplicaSnapshot(replica_id, role, **{**fields, **kw})


def pre(replica_id: str, **kw) -> ReplicaSnapshot:
    return snap(replica_id, "prefill", **kw)


def busy(replica_id: str, running: int, context_per_seq: int = 500, **kw) -> ReplicaSnapshot:
    """A decode replica with `running` sequences of `context_per_seq` tokens each."""
    context = running * context_per_seq
    free = 1000 - context // BS
    return snap(replica_id, num_running=running, num_free_blocks=free, num_context_tokens=context, **kw)


def req(prompt: int = 100, max_tokens: int = 32, ttft: float = 1.0, tpot: float = 0.1, **kw):
    return PlacementRequest(prompt, max_tokens, ttft, tpot, **kw)


def slo(has_prefill_pool: bool = True, **kw):
    """The ranking itself: the best choice always (test_randomized.py draws among the near-equal)."""
    kw = {"choice_tolerance": 0.0, **kw}
    return create_policy(PlacementConfig(transport="redis", calibrate_step_times=False, **kw), PROFILE,
                         has_prefill_pool)


HASHES = tuple(range(1000, 1094))  # 94 full blocks of a 1500-token prompt
LONG = req(1500, ttft=0.3)
LOCAL, NO_POOL, SPLIT = "local", "no_prefill_pool", "disaggregated"

# (name, request, prefill replicas, decode replicas, config, expected (disaggregate, prefill, decode, reason))
CASES = [
    ("short prompt prefills locally", req(100), [pre("p0")], [snap("d0")], {}, (False, None, "d0", LOCAL)),
    ("long prompt on a busy decode disaggregates", LONG, [pre("p0")], [busy("d0", 20)], {},
     (True, "p0", "d0", SPLIT)),
    ("long prompt on an idle decode stays local", LONG, [pre("p0")], [snap("d0")], {},
     (False, None, "d0", LOCAL)),
    ("replica-local prefix hit keeps it local", req(1500, ttft=0.3, block_hashes=HASHES), [pre("p0")],
     [busy("d0", 20, prefix_hashes=frozenset(HASHES))], {}, (False, None, "d0", "local_prefix_hit")),
    ("kvstore prefix hit keeps it local", req(1500, ttft=0.3, kvstore_hit_tokens=1440), [pre("p0")],
     [busy("d0", 20)], {}, (False, None, "d0", "local_prefix_hit")),
    ("lowest predicted TPOT wins", req(100), [], [busy("d0", 30), snap("d1"), busy("d2", 5)], {},
     (False, None, "d1", NO_POOL)),
    ("TPOT tie: most free blocks", req(100), [],
     [snap("d0", num_free_blocks=900, num_context_tokens=0),
      snap("d1", num_free_blocks=950, num_context_tokens=0)],
     {}, (False, None, "d1", NO_POOL)),
    ("full tie: lowest replica id", req(100), [], [snap("d1"), snap("d0")], {}, (False, None, "d0", NO_POOL)),
    ("full decode pool is skipped", req(1000, max_tokens=600), [],
     [snap("d0", num_free_blocks=50, num_context_tokens=0), busy("d1", 10)], {},
     (False, None, "d1", NO_POOL)),
    ("pending placements count as load", req(100), [], [snap("d0", num_pending=10), snap("d1")], {},
     (False, None, "d1", NO_POOL)),
    ("pending prefill tokens count as queue", LONG, [pre("p0", pending_prefill_tokens=3000), pre("p1")],
     [busy("d0", 20)], {}, (True, "p1", "d0", SPLIT)),
    ("stale replica skipped while others are fresh", req(100), [], [busy("d0", 5), snap("d1", age_s=30.0)],
     {},
     (False, None, "d0", NO_POOL)),
    ("earliest first token among prefill replicas", LONG,
     [pre("p0", queued_prefill_tokens=4000), pre("p1", queued_prefill_tokens=500)], [busy("d0", 20)], {},
     (True, "p1", "d0", SPLIT)),
    ("prefix credit on a prefill replica beats an idle one", req(1500, ttft=0.3, block_hashes=HASHES),
     [pre("p0"), pre("p1", queued_prefill_tokens=300, prefix_hashes=frozenset(HASHES))], [busy("d0", 20)], {},
     (True, "p1", "d0", SPLIT)),
    ("full prefill pool is skipped", LONG,
     [pre("p0", num_free_blocks=10), pre("p1", queued_prefill_tokens=500)], [busy("d0", 20)], {},
     (True, "p1", "d0", SPLIT)),
    ("colocated: no prefill pool, so local", LONG, [], [busy("d0", 20)],
     {"has_prefill_pool": False, "admission": "queue"}, (False, None, "d0", "colocated:over_slo:ttft")),
]


@pytest.mark.parametrize("name,request_,prefill,decode,config,expected", CASES, ids=[c[0] for c in CASES])
def test_slo_aware_table(name, request_, prefill, decode, config, expected):
    p = slo(**config).place(request_, prefill, decode)
    assert isinstance(p, Placement), p
    assert (p.disaggregate, p.prefill_replica, p.decode_replica, p.reason) == expected
    assert p.meets_slo == ("over_slo" not in p.reason)


def test_predictions_and_candidates_are_reported():
    p = slo().place(LONG, [pre("p1"), pre("p0", queued_prefill_tokens=1000)], [busy("d0", 20)])
    # decode: batch 21, context 20*500 + 1500 + 32/2
    assert p.predicted_tpot_s == pytest.approx(0.02 + 21e-3 + 11516e-6)
    # prefill on p1 in chunks of 640 (0.25 x TTFT), then 1.5 MB over redis
    assert p.prefill_chunk_tokens == 640
    assert p.predicted_ttft_s == pytest.approx(3 * 0.01 + 1500e-4 + 0.005 + 1500 * 1000 / 1e8)
    assert [(c.replica_id, c.role, c.metric) for c in p.candidates] == [
        ("d0", "decode", "tpot"), ("p1", "prefill", "ttft"), ("p0", "prefill", "ttft")]
    assert p.candidates[1].predicted_s < p.candidates[2].predicted_s


def test_local_chunk_budget_keeps_running_decodes_within_tpot():
    # 20 running decodes over 10k context: a step is 50 ms before any prefill; TPOT 100 ms leaves 50 ms,
    # 500 tokens at 10k tok/s (the 10 ms step overhead is counted once), so 496 is the largest block multiple
    p = slo(admission="queue").place(req(1500, ttft=10.0), [], [busy("d0", 20)])
    assert p.prefill_chunk_tokens == 496
    assert MODEL.mixed_step_s(20, 10000, 496) <= 0.1 < MODEL.mixed_step_s(20, 10000, 512)


def test_chunk_budget_is_at_least_one_block_and_flags_interference():
    p = slo(admission="queue").place(req(200, ttft=10.0, tpot=1.0), [], [busy("d0", 90)])
    assert p.prefill_chunk_tokens == 200  # the whole prompt fits the TTFT-derived chunk
    # 150 decodes over 15k context: 185 ms a step, and 186.2 ms with this request (TPOT 186.4 ms holds),
    # but a one-block chunk makes it 186.6 ms: the decode replica prefills anyway (no prefill pool), flagged
    p = slo(admission="queue").place(req(200, ttft=10.0, tpot=0.1864), [], [busy("d0", 150, 100)])
    assert p.prefill_chunk_tokens == BS
    assert not p.meets_slo and p.reason == "no_prefill_pool:over_slo:tpot_interference"


@pytest.mark.parametrize("limit,expected", [(0.0, 16), (0.01 + 16e-4, 16), (0.01 + 100e-4, 96), (1.0, 2048)])
def test_largest_chunk(limit, expected):
    assert largest_chunk(lambda c: MODEL.prefill_time_s(c), limit, 16, 2048) == expected


@pytest.mark.parametrize("hashes,cached,expected", [
    ((1, 2, 3), frozenset({1, 2, 3}), 48), ((1, 2, 3), frozenset({1, 3}), 16), ((1, 2), frozenset({2}), 0),
    ((1, 2), None, 0), ((), frozenset({1}), 0),
])
def test_prefix_hit_tokens(hashes, cached, expected):
    assert prefix_hit_tokens(hashes, cached, 16) == expected


def test_all_stale_replicas_are_used_with_the_penalty():
    fresh = slo().place(req(100), [], [busy("d0", 5)])
    stale = slo().place(req(100), [], [busy("d0", 5, age_s=60.0)])
    assert stale.decode_replica == "d0"
    assert stale.predicted_tpot_s == pytest.approx(2.0 * fresh.predicted_tpot_s)


def test_measured_step_times_scale_predictions():
    predicted = MODEL.decode_step_s(10, 5000)
    calibrated = create_policy(PlacementConfig(admission="queue"), PROFILE)
    base = calibrated.place(req(100), [], [busy("d0", 10)])
    def measured(seconds: float) -> ReplicaSnapshot:
        return busy("d0", 10, recent_step_time_s=seconds, recent_step_tokens=10.0)

    slow = calibrated.place(req(100), [], [measured(3 * predicted)])
    assert slow.predicted_tpot_s == pytest.approx(3 * base.predicted_tpot_s)
    capped = calibrated.place(req(100), [], [measured(100 * predicted)])
    assert capped.predicted_tpot_s == pytest.approx(8 * base.predicted_tpot_s)


@pytest.mark.parametrize("request_,prefill,decode,config,expected", [
    (req(1000, max_tokens=600), [], [snap("d0", num_free_blocks=50), snap("d1", num_free_blocks=99)], {},
     Rejection("kv_full", 1.0)),
    (req(100, tpot=0.05), [], [busy("d0", 40, 100)], {}, Rejection("tpot", 1.0)),
    (req(100, tpot=0.05), [], [busy("d0", 40, 100)], {"reject_factor": 2.0},
     "d0:no_prefill_pool:over_slo:tpot,tpot_interference"),
    (LONG, [pre("p0", queued_prefill_tokens=5000)], [busy("d0", 20, queued_prefill_tokens=4000)], {}, "ttft"),
    (req(1000, max_tokens=600), [], [snap("d0", num_free_blocks=50), snap("d1", num_free_blocks=99)],
     {"admission": "queue"}, "d1:no_prefill_pool:over_slo:kv_full"),
    (LONG, [pre("p0", queued_prefill_tokens=5000)], [busy("d0", 20, queued_prefill_tokens=4000)],
     {"admission": "queue"}, "d0:disaggregated:over_slo:ttft"),
])
def test_admission_control(request_, prefill, decode, config, expected):
    result = slo(**config).place(request_, prefill, decode)
    if isinstance(expected, Rejection):
        assert result == expected
    elif expected == "ttft":
        assert isinstance(result, Rejection) and result.reason == "ttft"
        assert result.retry_after_s >= 1.0
    else:
        assert isinstance(result, Placement) and not result.meets_slo
        assert f"{result.decode_replica}:{result.reason}" == expected


def test_ttft_rejection_retry_after_is_the_predicted_excess():
    d0 = snap("d0", queued_prefill_tokens=20000, num_free_blocks=4000, num_total_blocks=4000)
    queued = slo(admission="queue").place(req(100, ttft=0.3), [], [d0])
    rejected = slo().place(req(100, ttft=0.3), [], [d0])
    assert queued.predicted_ttft_s > 1.3
    assert rejected == Rejection("ttft", pytest.approx(queued.predicted_ttft_s - 0.3))


def test_priority_is_the_requests_own_type():
    for policy in (slo(), create_policy(PlacementConfig(policy="least_loaded"))):
        for decode in ([snap("d0")], []):
            assert policy.place(req(100, priority=Priority.BATCH), [], decode).priority is Priority.BATCH
            assert policy.place(req(100), [], decode).priority is Priority.INTERACTIVE
    assert Priority.of("batch") is Priority.BATCH and int(Priority.BATCH) == 1
    with pytest.raises(ValueError, match="priority"):
        Priority.of("urgent")


def test_round_robin_rotates_over_replica_ids():
    policy = create_policy(PlacementConfig(policy="round_robin"))
    prefill, decode = [pre("p1"), pre("p0")], [snap("d2"), snap("d0"), snap("d1")]
    placed = [policy.place(req(100), prefill, decode) for _ in range(4)]
    assert [(p.prefill_replica, p.decode_replica) for p in placed] == [
        ("p0", "d0"), ("p1", "d1"), ("p0", "d2"), ("p1", "d0")]
    assert policy.counter == 4
    short = policy.place(req(10), prefill, decode)
    assert (short.disaggregate, short.prefill_replica) == (False, None)
    assert short.reason == "short_prompt"


@pytest.mark.parametrize("decode,expected", [
    ([snap("d0", num_running=3), snap("d1", num_running=1, num_waiting=1)], "d1"),
    ([snap("d0", num_running=1), snap("d1", num_pending=2)], "d0"),
    ([snap("d0", num_running=1, num_free_blocks=10), snap("d1", num_running=1, num_free_blocks=20)], "d1"),
    ([snap("d0", num_free_blocks=20, pending_blocks=15), snap("d1", num_free_blocks=10)], "d1"),
    ([snap("d1"), snap("d0")], "d0"),
])
def test_least_loaded_order(decode, expected):
    policy = create_policy(PlacementConfig(policy="least_loaded"))
    placement = policy.place(req(100), [pre("p0", num_waiting=2), pre("p1")], decode)
    assert placement.decode_replica == expected
    assert placement.prefill_replica == "p1" and placement.reason == "long_prompt"


def test_registry():
    assert sorted(POLICIES) == ["kv_aware", "least_loaded", "round_robin", "slo_aware"]
    assert PlacementConfig().policy == "slo_aware"
    with pytest.raises(ValidationError, match="unknown placement policy"):
        PlacementConfig(policy="random")
    with pytest.raises(ValueError, match="latency profile"):
        create_policy(PlacementConfig())


def test_snapshot_from_engine_stats():
    stats = SimpleNamespace(num_running=2, num_waiting=1, queued_prefill_tokens=40, num_free_blocks=90,
                            num_total_blocks=100, block_size=16, recent_step_times_s=(0.1, 0.3),
                            recent_step_tokens=(2, 4), max_num_batched_tokens=512)
    s = ReplicaSnapshot.from_stats("d0", "decode", 0.5, stats, num_pending=3, pending_blocks=2)
    assert (s.recent_step_time_s, s.recent_step_tokens, s.load) == (pytest.approx(0.2), 3.0, 6)
    assert s.max_num_batched_tokens == 512
    assert s.context_tokens == (10 + 2) * 16


def test_placement_modules_are_torch_free():
    code = ("import sys, pdserve.placement.policy, pdserve.placement.slo_aware, "
            "pdserve.placement.pending, pdserve.prefix_hash; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_pending_placements_count_until_stats_show_them():
    now = [100.0]
    pending = PendingPlacements(grace_s=0.05, max_age_s=10.0, clock=lambda: now[0])
    request = req(100, max_tokens=60)
    pending.record_placement(Placement(True, "p0", "d0", SPLIT), request, BS)
    now[0] = 100.5
    pending.record_placement(Placement(False, None, "d0", LOCAL), request, BS)
    d0, p0 = pending.apply(snap("d0")), pending.apply(pre("p0"))
    assert (d0.num_pending, d0.pending_prefill_tokens, d0.pending_blocks) == (2, 100, 20)
    assert (p0.num_pending, p0.pending_prefill_tokens, p0.pending_blocks) == (1, 100, 7)
    pending.observe("d0", stats_taken_at=100.3)  # shows the first placement, not the second
    assert pending.apply(snap("d0")).num_pending == 1
    pending.observe("d0", stats_taken_at=100.52)  # within the grace period of the second
    assert pending.apply(snap("d0")).num_pending == 1
    now[0] = 111.0  # no stats for longer than max_age_s: forgotten
    assert pending.apply(pre("p0")).num_pending == 0


def test_a_request_that_ended_stops_counting_as_pending_before_stats_show_it():
    # sequential requests shorter than the poll period: without `done` each would load its replica until the
    # next stats, and three in a row pushed a replica holding a chat's history past kv_aware's load slack
    now = [100.0]
    pending = PendingPlacements(grace_s=0.05, max_age_s=10.0, clock=lambda: now[0])
    request = req(100, max_tokens=60)
    pending.record_placement(Placement(True, "p0", "d0", SPLIT), request, BS, key="a")
    pending.record_placement(Placement(False, None, "d0", LOCAL), request, BS, key="b")
    pending.record("d0", 5, 1, placed_at=99.9)  # another router's: no key, only stats or age clear it
    pending.done("a")
    d0, p0 = pending.apply(snap("d0")), pending.apply(pre("p0"))
    assert (d0.num_pending, d0.pending_prefill_tokens, d0.pending_blocks) == (2, 105, 11)
    assert p0.num_pending == 0  # the prefill replica's entry went with the request
    pending.done("unknown")
    pending.done(None)  # never clears the keyless entries
    pending.done("b")
    assert pending.apply(snap("d0")).num_pending == 1


def test_stats_poll_period_reaches_the_poller():
    from pdserve.services.router.placer import Placer

    placer = Placer(PlacementConfig(policy="least_loaded", stats_poll_period_s=0.5), None, "app", has_prefill=True)
    assert placer.poller.period_s == 0.5 and placer.poller.deployments == ("prefill", "decode")
    colocated = Placer(PlacementConfig(policy="least_loaded"), None, "app", has_prefill=False)
    assert colocated.poller.deployments == ("decode",) and not colocated.policy.has_prefill_pool
    with pytest.raises(ValidationError):
        PlacementConfig(stats_poll_period_s=0)


# every policy, before any stats: (topology, prompt tokens) -> (disaggregate, reason); Serve picks replicas
NO_STATS = [
    (True, 100, (True, "long_prompt")), (True, 32, (True, "long_prompt")), (True, 31, (False, "short_prompt")),
    (False, 100, (False, "colocated")),
]


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("has_prefill_pool,num_tokens,expected", NO_STATS)
def test_before_stats_every_policy_places_by_the_prompt_length_rule(policy, has_prefill_pool, num_tokens, expected):
    p = create_policy(PlacementConfig(policy=policy), PROFILE, has_prefill_pool).place(req(num_tokens), [], [])
    assert isinstance(p, Placement)
    assert (p.disaggregate, p.reason) == expected and (p.prefill_replica, p.decode_replica) == (None, None)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_simple_policies_follow_the_topology(policy):
    colocated = create_policy(PlacementConfig(policy=policy), None, has_prefill_pool=False)
    p = colocated.place(req(1000), [], [snap("d0")])
    assert (p.disaggregate, p.prefill_replica, p.decode_replica, p.reason) == (False, None, "d0", "colocated")
    pool = create_policy(PlacementConfig(policy=policy), None)  # a pool with no replica reporting yet
    assert pool.place(req(1000), [], [snap("d0")]).reason == "no_prefill_pool"


def test_chunk_cap_is_the_replicas_reported_token_budget():
    # an idle replica whose TTFT allows any chunk: the cap is what it reports, not a router-wide setting
    for budget in (256, 1024):
        p = slo(admission="queue").place(req(1500, ttft=100.0), [], [snap("d0", max_num_batched_tokens=budget)])
        assert p.prefill_chunk_tokens == budget
