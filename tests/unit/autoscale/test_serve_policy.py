"""The Serve glue (pdserve.autoscale.serve_policy) on Ray Serve's own AutoscalingContext and metric series:
replicas' counters become the window's traffic, gauges the role's stats, and the policy sizes its role."""

from __future__ import annotations

import pytest

from pdserve.autoscale.serve_policy import METRICS, STATE_KEY, SLORolePolicy, rate, role_inputs
from pdserve.bench.placement import h100_8b_profile

pytest.importorskip("ray")
from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue  # noqa: E402
from ray.serve.config import AutoscalingContext  # noqa: E402

PROFILE = h100_8b_profile().to_dict()
CONFIG = {"ttft_slo_s": 1.0, "tpot_slo_s": 0.05, "prefill": {"min_replicas": 1, "max_replicas": 8},
          "decode": {"min_replicas": 1, "max_replicas": 8}, "upscale_delay_s": 2.0, "downscale_delay_s": 0.0,
          "cooldown_s": 0.0}
BLOCKS = 29205


def series(*values: float, start: float = 100.0, step: float = 1.0) -> list[TimeStampedValue]:
    return [TimeStampedValue(start + i * step, v) for i, v in enumerate(values)]


def replica_metrics(rps: float, prompt: int, output_per_request: int, seconds: int = 10, **gauges: float) -> dict:
    """One replica's series: counters rising at `rps` requests/s over `seconds`, gauges held."""
    n = [rps * i for i in range(seconds + 1)]
    held = {"queued_prefill_tokens": 0, "num_running": 0, "num_used_blocks": 0, "num_total_blocks": BLOCKS,
            "block_size": 16, "max_num_seqs": 64, "max_num_batched_tokens": 2048, **gauges}
    out = {name: series(*[value] * (seconds + 1)) for name, value in held.items()}
    out |= {"num_requests": series(*n), "prompt_tokens": series(*[k * prompt for k in n]),
            "prompt_tokens_sq": series(*[k * prompt * prompt for k in n]),
            "output_tokens": series(*[k * output_per_request for k in n])}
    assert set(out) == set(METRICS)
    return out


def context(name: str, replicas: dict[str, dict], now: float, state: dict | None = None) -> AutoscalingContext:
    dep = DeploymentID(name=name, app_name="pdserve")
    ids = {key: ReplicaID(unique_id=key, deployment_id=dep) for key in replicas}
    raw = {metric: {ids[key]: m[metric] for key, m in replicas.items()} for metric in METRICS}
    return AutoscalingContext(
        deployment_id=dep, deployment_name=name, app_name="pdserve", current_num_replicas=len(replicas),
        target_num_replicas=len(replicas), running_replicas=list(ids.values()), total_num_requests=0.0,
        total_queued_requests=0.0, aggregated_metrics=None, raw_metrics=lambda: raw,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state=state or {},
        last_scale_up_time=None, last_scale_down_time=None, current_time=now, config=None)


def test_counters_become_rates_summed_over_replicas():
    a, b = replica_metrics(10.0, 4000, 99), replica_metrics(10.0, 4000, 99)
    raw = {m: {"a": a[m], "b": b[m]} for m in METRICS}
    assert rate(raw, "num_requests") == pytest.approx(20.0)
    inputs = role_inputs(raw, "prefill", 2, 110.0)
    assert inputs.traffic.arrival_rate_rps == pytest.approx(20.0)
    assert inputs.traffic.mean_prompt_tokens == pytest.approx(4000)
    assert inputs.traffic.prompt_tokens_cv2 == pytest.approx(0.0, abs=1e-9)
    assert inputs.traffic.mean_output_tokens == pytest.approx(100)
    assert inputs.prefill.num_total_blocks == 2 * BLOCKS and inputs.prefill.num_replicas == 2


def test_a_replica_with_one_point_adds_no_rate():
    raw = {"num_requests": {"a": series(5.0)}}
    assert rate(raw, "num_requests") == 0.0


@pytest.mark.parametrize(("role", "prompt", "output", "grows"), [
    ("prefill", 4000, 100, True),  # long prompts at 20 rps: prefill needs 3 (test_policy's table)
    ("decode", 4000, 100, False),  # ... decode does not grow
    ("prefill", 600, 700, False),  # long outputs: prefill holds
    ("decode", 600, 700, True),  # ... decode grows
])
def test_each_role_grows_on_its_own_load_after_the_upscale_delay(role, prompt, output, grows):
    policy = SLORolePolicy(CONFIG, PROFILE)
    replicas = {"r0": replica_metrics(20.0, prompt, output - 1)}
    first, state = policy(context(role, replicas, now=110.0))
    assert first == 1  # the need has not lasted upscale_delay_s yet
    later, state = policy(context(role, replicas, now=112.5, state=state))
    assert (later > 1) is grows, state
    assert STATE_KEY in state and state["reason"] in ("up", "hold")


def test_idle_replicas_shrink_to_the_minimum():
    policy = SLORolePolicy(CONFIG, PROFILE)
    idle = {f"r{i}": replica_metrics(0.0, 0, 0) for i in range(3)}
    desired, state = policy(context("decode", idle, now=200.0))
    assert desired == 1 and state["reason"] == "down"


def test_a_deployment_that_is_no_role_needs_the_role_named():
    policy = SLORolePolicy(CONFIG, PROFILE)
    with pytest.raises(ValueError, match="set the policy's role"):
        policy(context("router", {"r0": replica_metrics(1.0, 10, 10)}, now=110.0))
    assert SLORolePolicy(CONFIG, PROFILE, role="decode")(context("router", {"r0": replica_metrics(0.0, 0, 0)},
                                                                  now=110.0))[0] == 1
