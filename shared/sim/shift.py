"""The autoscaling run: a synthetic trace whose prompt:output mix shifts twice, served by a disaggregated
cluster that the SLO-driven autoscaler sizes, against static provisioning for the peak of each role.

The trace: `phases` of equal length (chat; long prompts, short outputs; short prompts, long outputs), the
mix ramping from one to the next over `ramp_s`; Poisson arrivals whose rate swings +-`swing` around
`mean_rate` once per phase (thinning of a homogeneous process). Reported: SLO attainment per window (by
arrival time), replica-hours against the static cluster of each role's peak count (simulated too), and
scale reversals per role per hour (a change opposite to that role's previous change).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from pdserve.autoscale import AutoscaleConfig, RoleStats, ScalingInputs, Traffic, decide
from pdserve.latency_model import LatencyProfile
from pdserve.loadtest.distributions import LengthDist, LogNormal
from pdserve.loadtest.slo import SLO
from pdserve.sim.cluster import Simulation
from pdserve.sim.config import ClusterSpec, SimRequest
from pdserve.sim.results import RequestRecord, aggregate, request_result
from pdserve.sim.scaling import SloScaler


@dataclass(frozen=True)
class Phase:
    name: str
    prompt: LengthDist
    output: LengthDist


DEFAULT_PHASES = (
    Phase("chat", LogNormal(1000, 500, 32, 8000), LogNormal(250, 120, 8, 1500)),
    Phase("long_prompt", LogNormal(4000, 1500, 256, 12000), LogNormal(100, 50, 8, 600)),
    Phase("long_output", LogNormal(600, 300, 32, 4000), LogNormal(700, 300, 32, 2000)),
)


@dataclass(frozen=True)
class ShiftTrace:
    duration_s: float = 7200.0
    mean_rate: float = 20.0  # requests/s
    swing: float = 0.3  # the rate moves between (1 - swing) and (1 + swing) x mean_rate
    ramp_s: float = 600.0  # each mix shift takes this long
    phases: tuple[Phase, ...] = DEFAULT_PHASES
    seed: int = 0

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.mean_rate <= 0 or not 0 <= self.swing < 1 or self.ramp_s < 0:
            raise ValueError("duration_s > 0, mean_rate > 0, 0 <= swing < 1 and ramp_s >= 0")
        if not self.phases:
            raise ValueError("at least one phase")

    @property
    def phase_s(self) -> float:
        return self.duration_s / len(self.phases)

    def rate(self, t: np.ndarray) -> np.ndarray:
        return self.mean_rate * (1 + self.swing * np.sin(2 * math.pi * t / self.phase_s))

    def weight_next(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index of the phase at t, share of the next phase's mix at t): the ramp ends at each boundary."""
        index = np.minimum((t // self.phase_s).astype(int), len(self.phases) - 1)
        into_next = (t - (index + 1) * self.phase_s + self.ramp_s) / self.ramp_s if self.ramp_s else t * 0 - 1
        share = np.where(index + 1 < len(self.phases), np.clip(into_next, 0.0, 1.0), 0.0)
        return index, share

    def requests(self) -> list[SimRequest]:
        rng = np.random.default_rng(self.seed)
        peak = self.mean_rate * (1 + self.swing)
        n = rng.poisson(peak * self.duration_s)
        times = np.sort(rng.uniform(0.0, self.duration_s, size=n))
        times = times[rng.uniform(0.0, peak, size=n) < self.rate(times)]
        index, share = self.weight_next(times)
        chosen = index + (rng.uniform(size=len(times)) < share)
        prompts = np.zeros(len(times), dtype=int)
        outputs = np.zeros(len(times), dtype=int)
        for k, phase in enumerate(self.phases):
            mask = chosen == k
            prompts[mask] = phase.prompt.sample(rng, int(mask.sum()))
            outputs[mask] = phase.output.sample(rng, int(mask.sum()))
        return [SimRequest(i, float(t), int(p), int(o)) for i, (t, p, o) in enumerate(zip(times, prompts, outputs))]


def window_attainment(records: Sequence[RequestRecord], slo: SLO, window_s: float, duration_s: float) -> list[float]:
    """SLO attainment of the requests arriving in each window."""
    out = []
    for k in range(math.ceil(duration_s / window_s)):
        inside = [r for r in records if k * window_s <= r.request.arrival_s < (k + 1) * window_s]
        results = [request_result(r) for r in inside]
        out.append(sum(slo.met(r) for r in results) / len(results) if results else 1.0)
    return out


def reversals(history: Sequence[dict[str, Any]], role: str) -> int:
    count, last = 0, 0
    for row in history:
        change = row[f"{role}_desired"] - row[f"{role}_current"]
        if change:
            direction = 1 if change > 0 else -1
            count += last == -direction
            last = direction
    return count


def warm_start(requests: Sequence[SimRequest], profile: LatencyProfile, spec: ClusterSpec,
               config: AutoscaleConfig, first_s: float = 60.0) -> dict[str, int]:
    """The counts the policy needs for the trace's first minute: the cluster is up before the trace starts."""
    head = [r for r in requests if r.arrival_s < first_s] or list(requests[:1])
    prompts = np.array([r.prompt_tokens for r in head], dtype=float)
    cv2 = float(prompts.var(ddof=1) / prompts.mean() ** 2) if len(head) > 1 else None
    traffic = Traffic(len(head) / first_s, float(prompts.mean()), sum(r.output_tokens for r in head) / len(head), cv2)
    roles = {role: RoleStats(1, num_total_blocks=engine.num_blocks, block_size=engine.block_size,
                             max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens)
             for role, engine in (("prefill", spec.prefill), ("decode", spec.decode))}
    decision = decide(ScalingInputs(0.0, traffic, roles["prefill"], roles["decode"]), profile, config, {},
                      spec.transport)
    return {"num_prefill": decision.prefill.needed, "num_decode": decision.decode.needed}


def static_run(profile: LatencyProfile, spec: ClusterSpec, requests: Sequence[SimRequest], slo: SLO,
               window_s: float, duration_s: float) -> dict[str, Any]:
    sim = Simulation(spec, profile, requests)
    records = sim.run()
    windows = window_attainment(records, slo, window_s, duration_s)
    return {"replicas": {"prefill": spec.num_prefill, "decode": spec.num_decode},
            "replica_hours": (spec.num_prefill + spec.num_decode) * sim.now / 3600,
            **aggregate(records, slo), "min_window_attainment": min(windows)}


def smallest_static(profile: LatencyProfile, spec: ClusterSpec, requests: Sequence[SimRequest], slo: SLO,
                    window_s: float, duration_s: float, target: float = 0.9,
                    known: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """From `spec`'s counts down, one role at a time, the smallest static cluster whose every window meets
    `target` (greedy: each role is cut while the run still passes); None when `spec` itself fails.
    `known`: `spec`'s own static_run, when already done."""
    best = known or static_run(profile, spec, requests, slo, window_s, duration_s)
    if best["min_window_attainment"] < target:
        return None
    for role in ("prefill", "decode"):
        while getattr(spec, f"num_{role}") > 1:
            trial = replace(spec, **{f"num_{role}": getattr(spec, f"num_{role}") - 1})
            run = static_run(profile, trial, requests, slo, window_s, duration_s)
            if run["min_window_attainment"] < target:
                break
            spec, best = trial, run
    return best


def run_shift(profile: LatencyProfile, spec: ClusterSpec, trace: ShiftTrace, config: AutoscaleConfig,
              window_s: float = 600.0, interval_s: float = 10.0, compare_static: bool = True,
              search_static: bool = False) -> dict[str, Any]:
    """`compare_static`: simulate the static cluster of each role's peak too; `search_static`: also the
    smallest static cluster that meets 0.9 in every window (several more runs of the whole trace)."""
    if spec.mode != "disaggregated":
        raise ValueError("the autoscaling run scales prefill and decode: it needs a disaggregated cluster")
    config.check_profile(profile, spec.decode.block_size)
    requests = trace.requests()
    slo = SLO(config.ttft_slo_s, config.tpot_slo_s)
    spec = replace(spec, **warm_start(requests, profile, spec, config))
    sim = Simulation(spec, profile, requests)
    scaler = SloScaler(sim, profile, config, interval_s)
    records = sim.run()
    hours = trace.duration_s / 3600
    peak = {role: max([row[f"{role}_desired"] for row in scaler.history] + [getattr(spec, f"num_{role}")])
            for role in ("prefill", "decode")}
    used = {role: s / 3600 for role, s in sim.replica_seconds().items()}
    windows = window_attainment(records, slo, window_s, trace.duration_s)
    result: dict[str, Any] = {
        "requests": len(records), "slo": slo.to_dict(),
        "initial_replicas": {"prefill": spec.num_prefill, "decode": spec.num_decode},
        "autoscaled": {**aggregate(records, slo), "min_window_attainment": min(windows),
                       "window_attainment": [round(w, 4) for w in windows],
                       "replica_hours": {**used, "total": sum(used.values())},
                       "reversals_per_hour": {r: reversals(scaler.history, r) / hours for r in ("prefill", "decode")},
                       "peak_replicas": peak},
        "timeline": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}
                     for row in scaler.history[:: max(1, round(60 / interval_s))]],
    }
    static_hours = (peak["prefill"] + peak["decode"]) * sim.now / 3600  # over the same span, to the last finish
    result["static_peak"] = {"replicas": peak, "replica_hours": static_hours}
    used_total = result["autoscaled"]["replica_hours"]["total"]
    result["replica_hours_saving"] = 1 - used_total / static_hours
    peak_spec = replace(spec, num_prefill=peak["prefill"], num_decode=peak["decode"])
    if compare_static:
        result["static_peak"].update(static_run(profile, peak_spec, requests, slo, window_s, trace.duration_s))
    if search_static:
        known = result["static_peak"] if compare_static else None
        smallest = smallest_static(profile, peak_spec, requests, slo, window_s, trace.duration_s, known=known)
        result["static_smallest"] = smallest
        if smallest is not None:
            result["replica_hours_saving_vs_smallest_static"] = 1 - used_total / smallest["replica_hours"]
    result["targets"] = {
        "min_window_attainment>=0.9": result["autoscaled"]["min_window_attainment"] >= 0.9,
        "replica_hours_saving>=0.25": result["replica_hours_saving"] >= 0.25,
        "reversals_per_role_per_hour<=2": all(v <= 2 for v in result["autoscaled"]["reversals_per_hour"].values()),
    }
    return result
