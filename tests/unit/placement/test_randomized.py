"""slo_aware's random choice among near-equal replicas (`choice_tolerance`): routers whose views lag each
other stop piling onto one replica, and nothing outside the tolerance, or over an SLO the best meets, is
ever drawn."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import ValidationError

from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel
from pdserve.placement.pending import PendingPlacements
from pdserve.placement.policy import PlacementConfig, PlacementRequest, ReplicaSnapshot, create_policy

BS = 16
# decode step: 20 ms + 1 ms a sequence + 1 us a context token; prefill 10k tok/s + 10 ms a step
PROFILE = LatencyProfile({"default": LatencyModel(
    PrefillModel(a=0.01, b=1e-4, c=0.0), DecodeModel(a=0.02, b=1e-3, c=1e-6), kv_bytes_per_token=1000)})


def snap(replica_id: str, role: str = "decode", running: int = 0, **kw) -> ReplicaSnapshot:
    context = running * 500
    fields = {"age_s": 0.05, "num_running": running, "num_waiting": 0, "queued_prefill_tokens": 0,
              "num_free_blocks": 1000 - context // BS, "num_total_blocks": 1000, "block_size": BS,
              "num_context_tokens": context}
    return ReplicaSnapshot(replica_id, role, **{**fields, **kw})


def policy(tolerance: float, seed: int = 0, has_prefill_pool: bool = False, policy: str = "slo_aware"):
    config = PlacementConfig(policy=policy, calibrate_step_times=False, choice_tolerance=tolerance, seed=seed,
                             admission="queue")
    return create_policy(config, PROFILE, has_prefill_pool)


def draws(p, request, prefill, decode, n=200) -> Counter:
    return Counter(p.place(request, prefill, decode).decode_replica for _ in range(n))


# predicted TPOT with a 100-token prompt and 32 outputs: d0 24.1 ms, d1 25.6 (+6%), d2 27.1 (+12%), d9 81 ms
DECODE = [snap("d0", running=2), snap("d1", running=3), snap("d2", running=4), snap("d9", running=40)]


@pytest.mark.parametrize("tolerance, tpot_slo, expected", [
    (0.0, 0.1, {"d0"}),  # the best, always
    (0.1, 0.1, {"d0", "d1"}),  # within 10% of the best
    (0.2, 0.1, {"d0", "d1", "d2"}),
    (1.0, 0.1, {"d0", "d1", "d2"}),  # d9 is 3.4x the best
    (0.2, 0.025, {"d0"}),  # the best meets the SLO: nothing over it is drawn
    (0.2, 0.02, {"d0", "d1", "d2"}),  # none meets it: near-equal by prediction alone
])
def test_draws_stay_within_the_tolerance_and_the_slo(tolerance, tpot_slo, expected):
    request = PlacementRequest(100, 32, 1.0, tpot_slo)
    assert set(draws(policy(tolerance), request, [], DECODE)) == expected


def test_the_same_seed_draws_the_same_replicas():
    request = PlacementRequest(100, 32, 1.0, 0.1)
    assert draws(policy(0.2, seed=7), request, [], DECODE) == draws(policy(0.2, seed=7), request, [], DECODE)


def _herd(tolerance: float, num_routers: int = 8, per_router: int = 4) -> Counter:
    """Routers that share one stale view of 8 idle replicas, each knowing only what it placed since."""
    view = [snap(f"d{i}") for i in range(8)]
    placed: Counter = Counter()
    for k in range(num_routers):
        p, pending = policy(tolerance, seed=k), PendingPlacements(grace_s=0.0, clock=lambda: 0.0)
        for _ in range(per_router):
            request = PlacementRequest(100, 32, 1.0, 0.1)
            placement = p.place(request, [], [pending.apply(s) for s in view])
            pending.record_placement(placement, request, BS)
            placed[placement.decode_replica] += 1
    return placed


def test_stale_views_herd_without_randomness_and_spread_with_it():
    herded, spread = _herd(0.0), _herd(0.2)
    assert sorted(herded.values()) == [8, 8, 8, 8]  # every router fills the same four replicas
    assert len(spread) == 8 and max(spread.values()) < 8


def test_prefill_replicas_are_drawn_among_the_near_equal():
    # a busy decode replica: local prefill would stall its decodes, so the prompt goes to the prefill pool
    decode = [snap("d0", running=20)]
    prefill = [snap("p0", "prefill"), snap("p1", "prefill"), snap("p2", "prefill", queued_prefill_tokens=5000)]
    request = PlacementRequest(1500, 32, 0.3, 0.1)  # local prefill: 0.35 s; p0 or p1: 0.17 s
    p = policy(0.2, has_prefill_pool=True)
    placements = [p.place(request, prefill, decode) for _ in range(100)]
    assert all(x.disaggregate and x.meets_slo for x in placements)
    assert set(Counter(x.prefill_replica for x in placements)) == {"p0", "p1"}


def test_kv_aware_keeps_its_own_ranking():
    request = PlacementRequest(100, 32, 1.0, 0.1)
    assert set(draws(policy(1.0, policy="kv_aware"), request, [], DECODE)) == {"d0"}


@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_a_tolerance_that_cannot_work_is_refused_naming_the_field(value):
    with pytest.raises(ValidationError, match="choice_tolerance"):
        PlacementConfig(choice_tolerance=value)


def test_pending_placements_do_not_make_a_replica_look_faster():
    """Step times were measured in the stats' state; the router's own placements since then add context
    that the measured steps never had. Dividing by a prediction that counts them made every replica a
    router was loading look faster than it is (slowdown < 1), so its predictions fell short exactly there:
    one router herded onto the fastest replicas' local prefill and missed TTFT."""
    p = create_policy(PlacementConfig(choice_tolerance=0.0), PROFILE)  # step-time calibration on
    model = p.decode_model
    measured = snap("d0", running=30, recent_step_tokens=30.0,
                    recent_step_time_s=model.decode_step_s(30, 30 * 500))
    loaded = PendingPlacements(grace_s=0.0, clock=lambda: 0.0)
    for _ in range(20):
        loaded.record("d0", 1000, 80)
    assert p.slowdown(loaded.apply(measured), model) == pytest.approx(1.0)
    assert p.slowdown(measured, model) == pytest.approx(1.0)
