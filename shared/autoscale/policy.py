"""SLO-driven replica counts per role, as a pure function of live stats, the latency model and the SLOs.

Prefill: replicas are M/G/1 queues of prompts (Kingman / Pollaczek-Khinchine): a prompt of the window's
mean length takes S (its chunks on the profile) plus the KV transfer; at utilisation rho = rate x S / n the
wait exceeds t with probability rho x exp(-t rho / Wq), Wq = rho S (1 + cv2) / (2 (1 - rho)), cv2 the
window's squared coefficient of variation of prompt lengths (service_cv2 when not given). The count is
the smallest whose predicted TTFT attainment reaches the target, plus what drains the queued prompt
tokens within backlog_drain_s. Decode: the largest batch b* whose step (mean context prompt + output / 2) fits
tpot_headroom x the TPOT SLO, max_num_seqs and kv_target_usage of a replica's blocks; the count serves the
window's output tokens per second at b*, and holds the blocks in use at kv_target_usage. Either role whose
observed attainment is below the target gets one more replica than the model asks for. So the
prefill:decode ratio follows the mix: longer prompts grow prefill, longer outputs grow decode.

Hysteresis: a role grows once its need has stayed above its count for upscale_delay_s, and shrinks once the
count the load needs at (1 - downscale_band) of capacity has stayed below it for downscale_delay_s (to the
largest such count seen meanwhile) and its observed attainment meets the target; no change reverses the
previous one within cooldown_s. The state that carries this between calls is a JSON-able dict per role,
the shape of Ray Serve's `policy_state`: an application-level Serve policy
`policy(contexts: dict[DeploymentID, AutoscalingContext]) -> (dict[DeploymentID, int], dict[DeploymentID,
dict])` builds `ScalingInputs` from the contexts' custom metrics, calls `decide` with each deployment's
`policy_state`, and returns `decision.replicas()` and `decision.state` per deployment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.autoscale.config import ROLES, AutoscaleConfig
from pdserve.latency_model import LatencyModel, LatencyProfile


@dataclass(frozen=True)
class RoleStats:
    """One role's live stats, summed over its replicas (ready or starting, not draining)."""

    num_replicas: int
    queued_prompt_tokens: int = 0
    num_running: int = 0
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    ttft_attainment: float | None = None  # observed over the window; None: too few requests
    tpot_attainment: float | None = None

    @classmethod
    def from_engine_stats(cls, stats: Sequence[Any], num_replicas: int | None = None, max_num_seqs: int = 64,
                          ttft_attainment: float | None = None, tpot_attainment: float | None = None) -> RoleStats:
        """Summed over the replicas' `EngineStats` (duck-typed, so this module stays torch-free), as a Serve
        policy gathers them; `num_replicas`: the deployment's count, starting replicas included."""
        return cls(
            num_replicas=len(stats) if num_replicas is None else num_replicas,
            queued_prompt_tokens=sum(s.queued_prefill_tokens for s in stats),
            num_running=sum(s.num_running for s in stats),
            num_used_blocks=sum(s.num_total_blocks - s.num_free_blocks for s in stats),
            num_total_blocks=sum(s.num_total_blocks for s in stats),
            block_size=stats[0].block_size if stats else 16, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=getattr(stats[0], "max_num_batched_tokens", 2048) if stats else 2048,
            ttft_attainment=ttft_attainment, tpot_attainment=tpot_attainment)


@dataclass(frozen=True)
class Traffic:
    """Over the window: arrivals per second and their mean prompt and output lengths (tokens)."""

    arrival_rate_rps: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    prompt_tokens_cv2: float | None = None  # squared coefficient of variation of prompt lengths; None: config's


@dataclass(frozen=True)
class ScalingInputs:
    now_s: float
    traffic: Traffic
    prefill: RoleStats
    decode: RoleStats


@dataclass(frozen=True)
class RoleDecision:
    current: int
    desired: int
    needed: int  # what the load needs now (bounded by min/max replicas)
    floor: int  # what it needs at (1 - downscale_band) of capacity: shrinking stops here
    predicted_attainment: float  # at the current count
    reason: str


@dataclass(frozen=True)
class Decision:
    prefill: RoleDecision
    decode: RoleDecision
    state: dict[str, dict[str, Any]]  # per role: the next call's `state`

    def replicas(self) -> dict[str, int]:
        return {"prefill": self.prefill.desired, "decode": self.decode.desired}


def prefill_service_s(model: LatencyModel, prompt_tokens: float, chunk: int) -> float:
    """One prompt alone on a replica, in chunks of `chunk` tokens (each attending to those before it)."""
    left, done, seconds = max(1, round(prompt_tokens)), 0, 0.0
    while left > 0:
        n = min(chunk, left)
        seconds += model.prefill_time_s(n, done)
        done, left = done + n, left - n
    return seconds


def ttft_attainment(rate: float, service_s: float, ttft_budget_s: float, n: int, cv2: float) -> float:
    if n <= 0:
        return 0.0 if rate > 0 else 1.0
    rho = rate * service_s / n
    if rho <= 0:
        return 1.0 if service_s <= ttft_budget_s else 0.0
    if rho >= 1 or service_s > ttft_budget_s:
        return 0.0
    mean_wait = rho * service_s * (1 + cv2) / (2 * (1 - rho))
    if mean_wait <= 0:
        return 1.0
    return 1.0 - rho * math.exp(-(ttft_budget_s - service_s) * rho / mean_wait)


def decode_batch(model: LatencyModel, stats: RoleStats, traffic: Traffic, config: AutoscaleConfig) -> tuple[int, float]:
    """(b*, step time at b*): the largest batch within the TPOT headroom, max_num_seqs and the KV target."""
    context = traffic.mean_prompt_tokens + traffic.mean_output_tokens / 2
    limit = config.tpot_slo_s * config.tpot_headroom
    most = stats.max_num_seqs
    if stats.num_total_blocks and stats.num_replicas:
        per_replica_tokens = stats.num_total_blocks / stats.num_replicas * stats.block_size
        seq_tokens = traffic.mean_prompt_tokens + traffic.mean_output_tokens
        most = min(most, max(1, int(per_replica_tokens * config.kv_target_usage / max(seq_tokens, 1))))
    lo, hi = 1, max(1, most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if model.decode_step_s(mid, round(mid * context)) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo, model.decode_step_s(lo, round(lo * context))


def _prefill_need(model: LatencyModel, stats: RoleStats, traffic: Traffic, config: AutoscaleConfig,
                  transfer_s: float, load_factor: float) -> tuple[int, float]:
    rate = traffic.arrival_rate_rps * load_factor
    service = prefill_service_s(model, traffic.mean_prompt_tokens, stats.max_num_batched_tokens)
    budget = config.ttft_slo_s - transfer_s
    bounds = config.prefill
    cv2 = config.service_cv2 if traffic.prompt_tokens_cv2 is None else traffic.prompt_tokens_cv2
    n = max(bounds.min_replicas, 1 if rate > 0 else 0)
    while n < bounds.max_replicas and ttft_attainment(rate, service, budget, n, cv2) < config.target_attainment:
        n += 1
    tokens_per_s = stats.max_num_batched_tokens / max(model.prefill_time_s(stats.max_num_batched_tokens), 1e-12)
    backlog = math.ceil(stats.queued_prompt_tokens * load_factor / (tokens_per_s * config.backlog_drain_s) - 1e-9)
    current = ttft_attainment(traffic.arrival_rate_rps, service, budget, stats.num_replicas, cv2)
    return min(n + backlog, bounds.max_replicas), current


def _decode_need(model: LatencyModel, stats: RoleStats, traffic: Traffic, config: AutoscaleConfig,
                 load_factor: float) -> tuple[int, float]:
    batch, step = decode_batch(model, stats, traffic, config)
    tokens_per_s = traffic.arrival_rate_rps * max(traffic.mean_output_tokens - 1, 0.0) * load_factor
    n = math.ceil(tokens_per_s * step / batch - 1e-9)
    if stats.num_total_blocks and stats.num_replicas:
        per_replica = stats.num_total_blocks / stats.num_replicas
        n = max(n, math.ceil(stats.num_used_blocks * load_factor / (per_replica * config.kv_target_usage) - 1e-9))
    capacity = stats.num_replicas * batch / step if step > 0 else math.inf
    current = 1.0 if tokens_per_s / load_factor <= capacity else capacity * load_factor / tokens_per_s
    return n, current


def _hysteresis(role: str, current: int, needed: int, floor: int, observed_ok: bool, now: float,
                state: Mapping[str, Any], config: AutoscaleConfig) -> tuple[int, dict[str, Any], str]:
    st = {"dir": 0, "since": now, "extreme": current, "last_change_s": None, "last_dir": 0, **state}
    bounds = config.bounds(role)
    if current < bounds.min_replicas or current > bounds.max_replicas:
        desired = min(max(current, bounds.min_replicas), bounds.max_replicas)
        st.update(dir=0, since=now, last_change_s=now, last_dir=1 if desired > current else -1)
        return desired, st, "bounds"
    if needed > current:
        direction, candidate = 1, needed
    elif floor < current and observed_ok:
        direction, candidate = -1, floor
    else:
        direction, candidate = 0, current
    if direction != st["dir"]:
        st.update(dir=direction, since=now, extreme=candidate)
    elif direction < 0:
        st["extreme"] = max(st["extreme"], candidate)
    if direction == 0:
        return current, st, "hold"
    delay = config.upscale_delay_s if direction > 0 else config.downscale_delay_s
    if now - st["since"] < delay:
        return current, st, "waiting" if direction > 0 else "waiting_down"
    if st["last_dir"] == -direction and st["last_change_s"] is not None and \
            now - st["last_change_s"] < config.cooldown_s:
        return current, st, "cooldown"
    target = candidate if direction > 0 else st["extreme"]
    step = max(-config.max_step, min(config.max_step, target - current))
    st.update(dir=0, since=now, extreme=current + step, last_change_s=now, last_dir=direction)
    return current + step, st, "up" if direction > 0 else "down"


def decide(inputs: ScalingInputs, profile: LatencyProfile, config: AutoscaleConfig,
           state: Mapping[str, Mapping[str, Any]] | None = None, transport: str | None = None) -> Decision:
    """Desired replicas per role. `state`: the previous Decision's `state` (None or {} at first)."""
    state = state or {}
    traffic, now = inputs.traffic, inputs.now_s
    if config.policy == "static":
        keep = {r: RoleDecision(getattr(inputs, r).num_replicas, getattr(inputs, r).num_replicas,
                                getattr(inputs, r).num_replicas, getattr(inputs, r).num_replicas, 1.0, "static")
                for r in ROLES}
        return Decision(keep["prefill"], keep["decode"], {r: dict(state.get(r, {})) for r in ROLES})
    prefill_model, decode_model = profile.for_role("prefill"), profile.for_role("decode")
    transfer = 0.0
    if transport is not None and transport in prefill_model.transfers:
        transfer = prefill_model.kv_transfer_s(round(traffic.mean_prompt_tokens), transport)
    relax = 1 / (1 - config.downscale_band)
    needs = {
        "prefill": (_prefill_need(prefill_model, inputs.prefill, traffic, config, transfer, 1.0),
                    _prefill_need(prefill_model, inputs.prefill, traffic, config, transfer, relax)[0],
                    inputs.prefill.ttft_attainment),
        "decode": (_decode_need(decode_model, inputs.decode, traffic, config, 1.0),
                   _decode_need(decode_model, inputs.decode, traffic, config, relax)[0],
                   inputs.decode.tpot_attainment),
    }
    decisions, new_state = {}, {}
    for role in ROLES:
        (needed, predicted), floor, observed = needs[role]
        current = getattr(inputs, role).num_replicas
        bounds = config.bounds(role)
        missing = observed is not None and observed < config.target_attainment
        if missing and needed <= current:
            needed = current + 1  # the model says enough, the window says otherwise
        needed = min(max(needed, bounds.min_replicas), bounds.max_replicas)
        floor = min(max(floor, needed), bounds.max_replicas)
        desired, new_state[role], reason = _hysteresis(role, current, needed, floor, not missing, now,
                                                       state.get(role, {}), config)
        decisions[role] = RoleDecision(current, desired, needed, floor, predicted, reason)
    return Decision(decisions["prefill"], decisions["decode"], new_state)
