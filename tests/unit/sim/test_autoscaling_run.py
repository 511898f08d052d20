"""The simulator driven by the autoscaler: the shifting trace, replicas added after their startup delay,
removed only after draining (every request finishes), and the run's report."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from pdserve.autoscale import AutoscaleConfig, RoleBounds
from pdserve.bench.placement import h100_8b_profile
from pdserve.placement.policy import PlacementConfig
from pdserve.sim import ClusterSpec, EngineSpec, RouterSpec, SimRequest, Simulation
from pdserve.sim.scaling import SloScaler
from pdserve.sim.shift import ShiftTrace, reversals, run_shift

PROFILE = h100_8b_profile()
SPEC = ClusterSpec(prefill=EngineSpec(num_blocks=29205), decode=EngineSpec(num_blocks=29205), startup_s=30.0,
                   router=RouterSpec(ttft_slo_s=1.0, tpot_slo_s=0.05,
                                     placement=PlacementConfig(policy="least_loaded", admission="queue")))
CONFIG = AutoscaleConfig(ttft_slo_s=1.0, tpot_slo_s=0.05, prefill=RoleBounds(1, 16), decode=RoleBounds(1, 16),
                         downscale_delay_s=60.0, cooldown_s=60.0)


def test_the_trace_shifts_its_mix_twice():
    trace = ShiftTrace(duration_s=3000.0, mean_rate=4.0, ramp_s=100.0)
    requests = trace.requests()
    phase = [[r for r in requests if k * 1000 <= r.arrival_s < k * 1000 + 900] for k in range(3)]
    prompt = [np.mean([r.prompt_tokens for r in p]) for p in phase]
    output = [np.mean([r.output_tokens for r in p]) for p in phase]
    assert prompt[1] > 2.5 * prompt[0] and output[2] > 2.5 * output[0]
    assert abs(len(requests) / 3000.0 - 4.0) < 0.4


def test_scaling_up_waits_for_startup_and_scaling_down_drains():
    # two minutes of long prompts at 20 req/s, then five of short chats at 1 req/s
    burst = [SimRequest(i, 0.05 * i, 4000, 50) for i in range(2400)]
    trickle = [SimRequest(2400 + i, 120.0 + i, 500, 100) for i in range(300)]
    sim = Simulation(replace(SPEC, num_prefill=1, num_decode=1), PROFILE, burst + trickle)
    scaler = SloScaler(sim, PROFILE, replace(CONFIG, upscale_delay_s=0.0), interval_s=10.0)
    records = sim.run()
    assert all(r.status == "ok" and r.finish_s is not None for r in records)  # nothing lost
    added = [r for r in (*sim.retired, *sim.replicas) if r.role == "prefill" and r.requested_s > 0]
    assert added and all(r.ready_s == r.requested_s + SPEC.startup_s for r in added)
    first_ready = min(r.ready_s for r in added)
    ids = {r.replica_id for r in added}
    assert all(rec.request.arrival_s >= first_ready for rec in records if rec.prefill_replica in ids)
    assert max(row["prefill_desired"] for row in scaler.history) > 1
    assert sim.retired  # scaled back down once the burst was over
    for replica in sim.retired:  # ... each replica only once its last request had left it
        served = [rec for rec in records if replica.replica_id in (rec.prefill_replica, rec.decode_replica)]
        left = [rec.first_token_s if rec.prefill_replica == replica.replica_id else rec.finish_s for rec in served]
        assert all(t <= replica.stopped_s for t in left)


def test_reversals_count_direction_changes_per_role():
    rows = [{"decode_current": c, "decode_desired": d} for c, d in ((1, 2), (2, 2), (2, 3), (3, 2), (2, 3))]
    assert reversals(rows, "decode") == 2


def test_a_short_autoscaling_run_reports_the_targets():
    trace = ShiftTrace(duration_s=300.0, mean_rate=3.0, ramp_s=30.0)
    result = run_shift(PROFILE, SPEC, trace, CONFIG, window_s=100.0, compare_static=False, search_static=True)
    scaled = result["autoscaled"]
    assert scaled["completed"] == result["requests"] and len(scaled["window_attainment"]) == 3
    assert 0 < scaled["replica_hours"]["total"] <= result["static_peak"]["replica_hours"]
    smallest = result["static_smallest"]
    assert smallest["min_window_attainment"] >= 0.9
    assert all(smallest["replicas"][r] <= result["static_peak"]["replicas"][r] for r in ("prefill", "decode"))
    assert set(result["targets"]) == {"min_window_attainment>=0.9", "replica_hours_saving>=0.25",
                                      "reversals_per_role_per_hour<=2"}
