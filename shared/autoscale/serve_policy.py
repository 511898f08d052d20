"""The SLO-driven policy as a Ray Serve deployment-level autoscaling policy (Serve 2.60 `AutoscalingPolicy`
with a class `policy_function`): Serve builds `SLORolePolicy(**policy_kwargs)` once in its controller and
calls it with each tick's `AutoscalingContext`; it returns (replicas, policy_state).

What it reads: the custom metrics that each replica's `record_autoscaling_stats` reports (METRICS), as
`ctx.raw_metrics[name][replica_id]` series over the deployment's `look_back_period_s`. Gauges (queued
prompt tokens, running sequences, KV blocks) are summed over the replicas' latest points; counters
(requests, prompt tokens, their squares, generated tokens) become rates over each replica's series. Those
give the role's `RoleStats` and the window's `Traffic`, from this role's replicas alone: a deployment-level
policy sees no other deployment. `decide` then sizes this role only (the other role's stats are a
placeholder whose decision is dropped), with the role's hysteresis state kept in Serve's `policy_state`.

Observed TTFT/TPOT attainment is not fed (None): requests' TTFT and TPOT are measured at the router,
which is not this deployment, and Serve hands a deployment policy only its own replicas' metrics. The
policy acts on the latency model's predictions and the replicas' queues and KV usage.

Serve applies its own upscale/downscale delays and scaling factors after the policy; the deployment's
`autoscaling_config` sets the delays to 0 so that `decide`'s hysteresis is the only one
(pdserve.services.autoscaling builds it). No Ray import: the controller unpickles this by reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.autoscale.config import ROLES, AutoscaleConfig
from pdserve.autoscale.policy import Decision, RoleStats, ScalingInputs, Traffic, decide
from pdserve.latency_model import LatencyProfile

POLICY_PATH = "pdserve.autoscale.serve_policy:SLORolePolicy"
GAUGES = ("queued_prefill_tokens", "num_running", "num_used_blocks", "num_total_blocks")
SETTINGS = ("block_size", "max_num_seqs", "max_num_batched_tokens")  # the same on every replica of a role
COUNTERS = ("num_requests", "prompt_tokens", "prompt_tokens_sq", "output_tokens")
METRICS = GAUGES + SETTINGS + COUNTERS
STATE_KEY = "pdserve"


def _points(series: Any) -> list[tuple[float, float]]:
    return sorted((float(p.timestamp), float(p.value)) for p in series or ())


def latest_sum(raw: Mapping[str, Mapping[Any, Any]], name: str) -> tuple[float, int]:
    """The replicas' latest values summed, and how many replicas reported one."""
    values = [pts[-1][1] for pts in (_points(s) for s in raw.get(name, {}).values()) if pts]
    return sum(values), len(values)


def rate(raw: Mapping[str, Mapping[Any, Any]], name: str) -> float:
    """A counter's rate per second, summed over replicas: each replica's rise over its series' span."""
    total = 0.0
    for series in raw.get(name, {}).values():
        pts = _points(series)
        if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
            total += max(0.0, pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
    return total


def role_inputs(raw: Mapping[str, Mapping[Any, Any]], role: str, num_replicas: int, now_s: float) -> ScalingInputs:
    """ScalingInputs for `role` from its replicas' custom metrics; `num_replicas`: Serve's target count
    (replicas starting included, so a replica on its way is not asked for twice)."""
    gauges = {name: latest_sum(raw, name) for name in GAUGES + SETTINGS}
    reporting = max(gauges["num_total_blocks"][1], 1)

    def setting(name: str, default: int) -> int:
        total, n = gauges[name]
        return round(total / n) if n else default

    arrivals = rate(raw, "num_requests")
    prompt_rate, prompt_sq_rate = rate(raw, "prompt_tokens"), rate(raw, "prompt_tokens_sq")
    mean_prompt = prompt_rate / arrivals if arrivals > 0 else 0.0
    cv2 = max(0.0, prompt_sq_rate / arrivals / mean_prompt ** 2 - 1) if mean_prompt > 0 else None
    # generated tokens per arriving request (+1: decode's first token came from prefill)
    mean_output = 1 + rate(raw, "output_tokens") / arrivals if arrivals > 0 else 1.0
    per_replica_blocks = gauges["num_total_blocks"][0] / reporting
    stats = RoleStats(
        num_replicas=num_replicas, queued_prompt_tokens=round(gauges["queued_prefill_tokens"][0]),
        num_running=round(gauges["num_running"][0]), num_used_blocks=round(gauges["num_used_blocks"][0]),
        num_total_blocks=round(per_replica_blocks * num_replicas), block_size=setting("block_size", 16),
        max_num_seqs=setting("max_num_seqs", 64), max_num_batched_tokens=setting("max_num_batched_tokens", 2048))
    placeholder = RoleStats(num_replicas=1)
    traffic = Traffic(arrivals, mean_prompt, mean_output, cv2)
    both = {r: stats if r == role else placeholder for r in ROLES}
    return ScalingInputs(now_s, traffic, both["prefill"], both["decode"])


class SLORolePolicy:
    """One role's Serve policy. `config`: pdserve.autoscale.AutoscaleConfig fields (as from_dict takes);
    `profile`: a LatencyProfile as JSON; `role`: prefill | decode (default: the deployment's name);
    `transport`: the KV transport whose transfer time the TTFT budget leaves out (None: none)."""

    def __init__(self, config: Mapping[str, Any], profile: Mapping[str, Any], role: str | None = None,
                 transport: str | None = None) -> None:
        self.config = AutoscaleConfig.from_dict(dict(config))
        self.profile = LatencyProfile.from_dict(profile)
        if role is not None and role not in ROLES:
            raise ValueError(f"role: {role!r} is not one of {list(ROLES)}")
        self.role, self.transport = role, transport

    def decide(self, ctx: Any) -> tuple[Decision, str]:
        role = self.role or ctx.deployment_name
        if role not in ROLES:
            raise ValueError(f"deployment {ctx.deployment_name!r}: set the policy's role (one of {list(ROLES)})")
        inputs = role_inputs(ctx.raw_metrics or {}, role, int(ctx.target_num_replicas), float(ctx.current_time))
        state = (ctx.policy_state or {}).get(STATE_KEY) or {}
        return decide(inputs, self.profile, self.config, {role: state}, self.transport), role

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        decision, role = self.decide(ctx)
        chosen = getattr(decision, role)
        return chosen.desired, {STATE_KEY: decision.state[role], "reason": chosen.reason, "needed": chosen.needed,
                                "predicted_attainment": chosen.predicted_attainment}
