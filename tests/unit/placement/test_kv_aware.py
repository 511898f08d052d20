"""Placement with prefix credit: the kv_aware policy (with and without a latency profile), slo_aware's credit
for the Redis tier only when the pull is predicted faster, and the Placer's pull decision and bookkeeping."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.kv_events import KVEventBatch
from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel, TransferModel
from pdserve.prefix_hash import prompt_block_hashes
from pdserve.placement.policy import Placement, PlacementConfig, PlacementRequest, ReplicaSnapshot, create_policy
from pdserve.services.router.replica_stats import ReplicaStats

BS = 16
# prefill 10k tok/s + 10 ms a step; decode 20 ms + 1 ms a sequence + 1 us a context token; redis 10 us a token
MODEL = LatencyModel(
    PrefillModel(a=0.01, b=1e-4, c=0.0), DecodeModel(a=0.02, b=1e-3, c=1e-6), kv_bytes_per_token=1000,
    transfers={"redis": TransferModel(latency_s=0.005, bandwidth_bytes_s=1e8)},
)
PROFILE = LatencyProfile({"default": LatencyModel(MODEL.prefill, MODEL.decode, 1000, {
    "redis": MODEL.transfers["redis"], "tier": MODEL.transfers["redis"]})})
# the handoff as fast, but prefix pulls (kvstore_transport "tier") slower than recomputing: 1 ms a token
SLOW_TIER = LatencyProfile({"default": LatencyModel(MODEL.prefill, MODEL.decode, 1000, {
    **MODEL.transfers, "tier": TransferModel(latency_s=0.005, bandwidth_bytes_s=1e6)})})

HASHES = tuple(range(1000, 1094))  # 94 full blocks of a 1500-token prompt
HALF = frozenset(HASHES[:47])


def snap(replica_id: str, role: str = "decode", **kw) -> ReplicaSnapshot:
    fields = {"age_s": 0.1, "num_running": 0, "num_waiting": 0, "queued_prefill_tokens": 0,
              "num_free_blocks": 1000, "num_total_blocks": 1000, "block_size": BS}
    return ReplicaSnapshot(replica_id, role, **{**fields, **kw})


def pre(replica_id: str, **kw) -> ReplicaSnapshot:
    return snap(replica_id, "prefill", **kw)


def busy(replica_id: str, running: int, context_per_seq: int = 500, **kw) -> ReplicaSnapshot:
    context = running * context_per_seq
    return snap(replica_id, num_running=running, num_free_blocks=1000 - context // BS, num_context_tokens=context,
                **kw)


def req(prompt: int = 1500, max_tokens: int = 32, ttft: float = 1.0, tpot: float = 0.1, **kw):
    return PlacementRequest(prompt, max_tokens, ttft, tpot, **{"block_hashes": HASHES, **kw})


def kv_aware(profile=PROFILE, has_prefill_pool: bool = False, **kw):
    config = PlacementConfig(policy="kv_aware", transport="redis", calibrate_step_times=False, admission="queue", **kw)
    return create_policy(config, profile, has_prefill_pool)


CACHED = frozenset(HASHES)

# (name, request, prefill replicas, decode replicas, expected (disaggregate, prefill, decode))
PREDICTED = [
    ("the replica holding the prefix wins over idle ones", req(), [],
     [snap("d0"), snap("d1", prefix_hashes=CACHED), snap("d2")], (False, None, "d1")),
    ("a longer prefix beats a shorter one", req(), [],
     [snap("d0", prefix_hashes=HALF), snap("d1", prefix_hashes=CACHED)], (False, None, "d1")),
    ("a hot replica is not buried: a long queue outweighs the hit", req(), [],
     [snap("d0"), snap("d1", prefix_hashes=CACHED, queued_prefill_tokens=30000)], (False, None, "d0")),
    ("a queue shorter than the saving still loses to the hit", req(), [],
     [snap("d0"), snap("d1", prefix_hashes=CACHED, queued_prefill_tokens=600)], (False, None, "d1")),
    ("TPOT over the SLO outweighs the hit", req(tpot=0.05), [],
     [snap("d0"), busy("d1", 40, prefix_hashes=CACHED)], (False, None, "d0")),
    ("no prefix anywhere: the least loaded by prediction", req(), [],
     [busy("d0", 10), snap("d1"), busy("d2", 5)], (False, None, "d1")),
    ("an unknown pool (None) gets no credit", req(), [],
     [snap("d0", prefix_hashes=None, num_free_blocks=990), snap("d1", num_free_blocks=999)], (False, None, "d1")),
    ("within the SLO headroom everywhere, the hit wins on a busier replica", req(ttft=10.0, tpot=1.0), [],
     [snap("d0"), busy("d1", 30, prefix_hashes=CACHED)], (False, None, "d1")),
    ("past the headroom the busy replica competes on cost", req(ttft=10.0, tpot=0.1), [],
     [snap("d0"), busy("d1", 30, prefix_hashes=CACHED)], (False, None, "d0")),
    ("disaggregated: the prefill replica holding the prefix", req(ttft=0.3), [pre("p0"), pre("p1", prefix_hashes=CACHED, queued_prefill_tokens=300)],
     [busy("d0", 20)], (True, "p1", "d0")),
    ("disaggregated: a decode replica holding the prefix prefills locally", req(ttft=0.3), [pre("p0")],
     [busy("d0", 20), busy("d1", 20, prefix_hashes=CACHED)], (False, None, "d1")),
]


@pytest.mark.parametrize("name,request_,prefill,decode,expected", PREDICTED, ids=[c[0] for c in PREDICTED])
def test_kv_aware_with_a_profile(name, request_, prefill, decode, expected):
    p = kv_aware(has_prefill_pool=bool(prefill)).place(request_, prefill, decode)
    assert isinstance(p, Placement), p
    assert (p.disaggregate, p.prefill_replica, p.decode_replica) == expected
    assert all(c.metric == "slo_cost" for c in p.candidates if c.role == "decode")


def test_while_both_replicas_are_comfortable_the_hit_wins_over_a_lower_cost():
    """The busy replica holding the prefix costs more by the SLO-normalised sum (its decode step is
    slower), yet both predictions sit within half the SLOs, so the least prefill work wins; with the
    headroom at its smallest the same replicas are ranked by cost."""
    request, decode = req(ttft=10.0, tpot=1.0), [snap("d0"), busy("d1", 30, prefix_hashes=CACHED)]
    p = kv_aware().place(request, [], decode)
    cost = {c.replica_id: c.predicted_s for c in p.candidates if c.role == "decode"}
    assert p.decode_replica == "d1" and cost["d1"] > cost["d0"]
    assert kv_aware(kv_aware_slo_headroom=0.001).place(request, [], decode).decode_replica == "d0"


AFFINITY = [
    ("the longest prefix among near-equal loads", req(), [],
     [snap("d0"), snap("d1", num_running=2, prefix_hashes=CACHED), snap("d2", prefix_hashes=HALF)], (False, None, "d1")),
    ("beyond the load slack the prefix no longer counts", req(), [],
     [snap("d0"), snap("d1", num_running=3, prefix_hashes=CACHED), snap("d2", num_running=1, prefix_hashes=HALF)],
     (False, None, "d2")),
    ("pending placements are load too", req(), [],
     [snap("d0"), snap("d1", num_pending=3, prefix_hashes=CACHED)], (False, None, "d0")),
    ("no prefix: least loaded, then most free blocks, then id", req(), [],
     [snap("d2", num_running=1), snap("d1", num_free_blocks=900), snap("d0", num_free_blocks=900)],
     (False, None, "d0")),
    ("prefill pool: affinity there, and the prompt-length rule", req(), [pre("p0"), pre("p1", prefix_hashes=HALF)],
     [snap("d0")], (True, "p1", "d0")),
]


@pytest.mark.parametrize("name,request_,prefill,decode,expected", AFFINITY, ids=[c[0] for c in AFFINITY])
def test_kv_aware_without_a_profile(name, request_, prefill, decode, expected):
    p = kv_aware(profile=None, has_prefill_pool=bool(prefill)).place(request_, prefill, decode)
    assert (p.disaggregate, p.prefill_replica, p.decode_replica) == expected


def slo_aware(profile=PROFILE):
    return create_policy(PlacementConfig(transport="redis", kvstore_transport="tier", calibrate_step_times=False),
                         profile, True)


def test_slo_aware_credits_the_redis_tier_only_when_the_pull_is_faster():
    request = req(ttft=0.3, kvstore_hit_tokens=1440)
    p = slo_aware().place(request, [pre("p0")], [busy("d0", 20)])
    assert (p.disaggregate, p.reason) == (False, "local_prefix_hit")
    # pulled at 10 us a token + 5 ms instead of computed at 100 us a token
    assert p.predicted_ttft_s < 0.3
    slow = slo_aware(SLOW_TIER).place(request, [pre("p0")], [busy("d0", 20)])
    assert (slow.disaggregate, slow.reason) == (True, "disaggregated")  # no credit: as without the tier


def test_slo_aware_prefix_credit_lowers_the_predicted_ttft_by_the_cached_tokens():
    plain = slo_aware().place(req(ttft=10.0, block_hashes=()), [], [snap("d0")])
    hit = slo_aware().place(req(ttft=10.0), [], [snap("d0", prefix_hashes=HALF)])
    assert hit.reason == "no_prefill_pool" and plain.reason == "no_prefill_pool"
    # 752 tokens fewer at 100 us each
    assert plain.predicted_ttft_s - hit.predicted_ttft_s == pytest.approx(752 * 1e-4, rel=0.05)


# --- the Placer: hashing once, the pull decision, bookkeeping -----------------------------------------------

STATS = {"num_running": 0, "num_waiting": 0, "queued_prefill_tokens": 0, "num_free_blocks": 1000,
         "num_total_blocks": 1000, "block_size": BS, "recent_step_times_s": [], "recent_step_tokens": [],
         "max_num_batched_tokens": 2048}


def placer(policy="kv_aware", profile=PROFILE, **config):
    from pdserve.services.router.placer import Placer

    p = Placer(PlacementConfig(policy=policy, calibrate_step_times=False, admission="queue",
                               kvstore_transport="tier", **config), profile,
               "app", has_prefill=False)
    for replica in ("d0", "d1"):
        p.poller._latest[("decode", replica)] = ReplicaStats(replica, "decode", dict(STATS), time.monotonic())
    return p


def pool(p, replica: str, hashes) -> None:
    p.index.apply(replica, KVEventBatch(f"epoch-{replica}", 1, True, hashes=tuple(hashes)), layout_hash=42)


PROMPT = tuple(range(500, 1300))  # 800 tokens: 49 hashable blocks


@pytest.mark.parametrize("policy", ["kv_aware", "least_loaded", "round_robin", "slo_aware"])
def test_the_placer_reports_the_prefix_of_the_replica_it_chose(policy):
    p = placer(policy)
    hashes = prompt_block_hashes(PROMPT, BS)
    pool(p, "d0", hashes)
    pool(p, "d1", hashes)
    placement = asyncio.run(p.place(PlacementRequest(len(PROMPT), 8, 5.0, 1.0), PROMPT))
    assert placement.prefix_hit_tokens == 49 * BS and placement.prefix_pull_blocks == 0
    # the pending prefill on that replica is what it must still compute
    chosen = [s for s in p.snapshots("decode") if s.replica_id == placement.decode_replica][0]
    assert chosen.pending_prefill_tokens == len(PROMPT) - 49 * BS


def test_kv_aware_follows_the_index_and_expects_the_blocks_it_placed():
    p = placer()
    hashes = prompt_block_hashes(PROMPT, BS)
    pool(p, "d0", ())
    pool(p, "d1", hashes[:30])
    first = asyncio.run(p.place(PlacementRequest(len(PROMPT), 8, 5.0, 1.0), PROMPT))
    assert first.decode_replica == "d1" and first.prefix_hit_tokens == 30 * BS
    assert p.index.match("d1", hashes) == 49  # expected there now, before its events say so
    assert p.index.match("d0", hashes) == 0


@pytest.mark.parametrize("profile,stored,local,expected_pull", [
    (PROFILE, 40, 10, 40),  # the tier has more, and pulling 30 blocks beats computing them
    (PROFILE, 10, 10, 0),  # nothing beyond the pool
    (SLOW_TIER, 40, 10, 0),  # a pull slower than the prefill
    (None, 40, 10, 40),  # no model: pull
])
def test_the_prefilling_replica_pulls_what_only_the_tier_holds(profile, stored, local, expected_pull):
    p = placer("kv_aware" if profile is not None else "least_loaded", profile)
    del p.poller._latest[("decode", "d1")]
    hashes = prompt_block_hashes(PROMPT, BS)
    pool(p, "d0", hashes[:local])
    request = PlacementRequest(len(PROMPT), 8, 5.0, 1.0, block_hashes=hashes, kvstore_hit_tokens=stored * BS)
    placement = p._with_prefix(Placement(False, None, "d0", "local"), request, {"d0": p.snapshots("decode")[0]})
    assert placement.prefix_pull_blocks == expected_pull
    assert placement.prefix_hit_tokens == max(local, expected_pull) * BS
