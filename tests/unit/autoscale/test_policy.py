"""The SLO-driven autoscaling policy as a pure function: tables of inputs -> desired replicas per role."""

from __future__ import annotations

import random

import pytest
from pdserve.autoscale import AutoscaleConfig, RoleBounds, RoleStats, ScalingInputs, Traffic, decide
from pdserve.bench.placement import h100_8b_profile

PROFILE = h100_8b_profile()
BLOCKS = 29205


def config(**overrides) -> AutoscaleConfig:
    base = {"ttft_slo_s": 1.0, "tpot_slo_s": 0.05, "prefill": RoleBounds(1, 32), "decode": RoleBounds(1, 32),
            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0, "cooldown_s": 0.0}
    return AutoscaleConfig(**{**base, **overrides})


def inputs(now: float, rate: float, prompt: float, output: float, prefill: int = 1, decode: int = 1,
           prefill_stats: dict | None = None, decode_stats: dict | None = None) -> ScalingInputs:
    def role(n: int, stats: dict | None) -> RoleStats:
        return RoleStats(n, num_total_blocks=BLOCKS * n, **(stats or {}))

    return ScalingInputs(now, Traffic(rate, prompt, output), role(prefill, prefill_stats), role(decode, decode_stats))


def needed(rate: float, prompt: float, output: float) -> tuple[int, int]:
    d = decide(inputs(0.0, rate, prompt, output), PROFILE, config())
    return d.prefill.needed, d.decode.needed


@pytest.mark.parametrize(("rate", "prompt", "output", "prefill", "decode"), [
    (0.0, 1000, 250, 1, 1),  # idle: the minimum
    (20.0, 1000, 250, 1, 1),  # chat: a 1000-token prefill takes 24 ms (rho 0.48)
    (20.0, 4000, 100, 3, 1),  # long prompts (90 ms each): prefill grows, decode does not
    (20.0, 600, 700, 1, 2),  # long outputs: decode grows, prefill does not
    (30.0, 600, 700, 1, 3),
    (40.0, 4000, 100, 5, 1),  # twice the long-prompt load
])
def test_needed_replicas_table(rate, prompt, output, prefill, decode):
    assert needed(rate, prompt, output) == (prefill, decode)


def test_the_prefill_decode_ratio_follows_the_mix():
    long_prompts, long_outputs = needed(30.0, 4000, 100), needed(30.0, 600, 700)
    assert long_prompts[0] > long_outputs[0] and long_prompts[1] < long_outputs[1]


def test_queued_prompt_tokens_add_prefill_replicas():
    quiet = decide(inputs(0.0, 10.0, 1000, 250), PROFILE, config())
    backlog = decide(inputs(0.0, 10.0, 1000, 250, prefill_stats={"queued_prompt_tokens": 3_000_000}), PROFILE, config())
    assert backlog.prefill.needed > quiet.prefill.needed
    assert backlog.decode.needed == quiet.decode.needed


def test_kv_usage_adds_decode_replicas():
    full = decide(inputs(0.0, 1.0, 1000, 250, decode_stats={"num_used_blocks": BLOCKS}), PROFILE, config())
    assert full.decode.needed == 2  # a full pool held at kv_target_usage 0.8


def test_observed_misses_add_one_replica_beyond_the_model():
    ok = decide(inputs(0.0, 20.0, 1000, 250, prefill=2, decode_stats={"tpot_attainment": 0.99}), PROFILE, config())
    missing = decide(inputs(0.0, 20.0, 1000, 250, prefill=2, decode_stats={"tpot_attainment": 0.5}), PROFILE, config())
    assert (ok.decode.desired, missing.decode.desired) == (1, 2)


def test_upscale_waits_for_its_delay():
    cfg = config(upscale_delay_s=30.0)
    state, desired = None, []
    for t in (0.0, 10.0, 20.0, 30.0):
        d = decide(inputs(t, 20.0, 4000, 100), PROFILE, cfg, state)
        state = d.state
        desired.append(d.prefill.desired)
    assert desired == [1, 1, 1, 3]


def test_downscale_waits_for_its_delay_and_keeps_the_largest_need_seen():
    cfg = config(downscale_delay_s=60.0, max_step=8)

    def run(rates: tuple[float, ...]) -> list[int]:
        state, desired = None, []
        for k, rate in enumerate(rates):
            d = decide(inputs(30.0 * k, rate, 4000, 100, prefill=6), PROFILE, cfg, state)
            state = d.state
            desired.append(d.prefill.desired)
        return desired

    assert run((5.0, 5.0, 5.0)) == [6, 6, 1]
    assert run((5.0, 10.0, 5.0)) == [6, 6, 2]  # 10 req/s at (1 - band) of capacity needs 2


def test_cooldown_blocks_a_reversal():
    cfg = config(cooldown_s=300.0)
    up = decide(inputs(0.0, 20.0, 4000, 100), PROFILE, cfg)
    assert up.prefill.desired == 3
    state = up.state
    for t in (10.0, 100.0, 290.0):  # the load is gone at once: no shrink inside the cooldown
        d = decide(inputs(t, 1.0, 4000, 100, prefill=3), PROFILE, cfg, state)
        assert (d.prefill.desired, d.prefill.reason) == (3, "cooldown")
        state = d.state
    d = decide(inputs(300.0, 1.0, 4000, 100, prefill=3), PROFILE, cfg, state)
    assert d.prefill.desired == 1


def test_no_flapping_on_noisy_input():
    """An hour of stats every 10 s, the rate +-15% noise around a steady 25 req/s of long prompts."""
    cfg = AutoscaleConfig(ttft_slo_s=1.0, tpot_slo_s=0.05, prefill=RoleBounds(1, 32), decode=RoleBounds(1, 32))
    rng = random.Random(0)
    state, counts = None, {"prefill": 4, "decode": 1}
    changes = {"prefill": 0, "decode": 0}
    for k in range(360):
        rate = 25.0 * rng.uniform(0.85, 1.15)
        d = decide(inputs(k * 10.0, rate, 4000, 100, counts["prefill"], counts["decode"]), PROFILE, cfg, state)
        state = d.state
        for role, n in d.replicas().items():
            changes[role] += n != counts[role]
            counts[role] = n
    assert changes["decode"] == 0
    assert changes["prefill"] <= 1  # at most one step up to the noise's peak need, never back and forth


def test_bounds_are_enforced_at_once():
    cfg = config(prefill=RoleBounds(2, 3), upscale_delay_s=1e6)
    assert decide(inputs(0.0, 0.0, 1000, 100, prefill=1), PROFILE, cfg).prefill.desired == 2
    assert decide(inputs(0.0, 0.0, 1000, 100, prefill=5), PROFILE, cfg).prefill.desired == 3
    assert decide(inputs(0.0, 500.0, 4000, 100, prefill=3), PROFILE, config(prefill=RoleBounds(1, 3))).prefill.needed == 3


def test_max_step_limits_one_decision():
    d = decide(inputs(0.0, 100.0, 4000, 100), PROFILE, config(max_step=2))
    assert d.prefill.needed > 3 and d.prefill.desired == 3


def test_static_policy_holds_the_counts():
    d = decide(inputs(0.0, 100.0, 4000, 700, prefill=2, decode=3), PROFILE, config(policy="static"))
    assert d.replicas() == {"prefill": 2, "decode": 3}


def test_state_is_plain_data():
    import json

    d = decide(inputs(0.0, 20.0, 4000, 100), PROFILE, config(upscale_delay_s=30.0))
    assert json.loads(json.dumps(d.state)) == d.state and set(d.state) == {"prefill", "decode"}


def test_role_stats_sum_the_replicas_engine_stats():
    from types import SimpleNamespace

    def engine(queued: int, running: int, free: int) -> SimpleNamespace:
        return SimpleNamespace(queued_prefill_tokens=queued, num_running=running, num_free_blocks=free,
                               num_total_blocks=100, block_size=16, max_num_batched_tokens=4096)

    stats = RoleStats.from_engine_stats([engine(500, 3, 90), engine(1500, 5, 40)], num_replicas=3,
                                        ttft_attainment=0.97)
    assert stats == RoleStats(3, queued_prompt_tokens=2000, num_running=8, num_used_blocks=70, num_total_blocks=200,
                              block_size=16, max_num_seqs=64, max_num_batched_tokens=4096, ttft_attainment=0.97)


def test_the_prompt_length_spread_sets_the_prefill_queue_tail():
    def prefill_needed(cv2: float | None) -> int:
        traffic = Traffic(26.0, 4000, 100, cv2)
        stats = RoleStats(1, num_total_blocks=BLOCKS)
        return decide(ScalingInputs(0.0, traffic, stats, stats), PROFILE, config()).prefill.needed

    assert prefill_needed(0.0) < prefill_needed(1.0) == prefill_needed(None)  # None: service_cv2 (1.0)
