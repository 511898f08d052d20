"""A committed live report's runs in the simulator (pdserve.sim): the report's configuration, a calibration per
target, and each point simulated over the phases of the routers' polls. `pdserve-loadtest validate` puts its
predictions beside the measured figures (pdserve.loadtest.validate)."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from collections.abc import Mapping
from typing import Any

from pdserve.latency_model import LatencyProfile
from pdserve.loadtest.batch_probe import BatchProbe
from pdserve.loadtest.evaluate import PROBE_SEED
from pdserve.loadtest.provenance import KV_PARTS, KV_PARTS_SINCE, STATS_COUNT_ARRIVING
from pdserve.loadtest.runner import LoadConfig
from pdserve.loadtest.scenario import Scenario
from pdserve.loadtest.slo import SLO
from pdserve.loadtest.sweep import SweepConfig
from pdserve.loadtest.workloads import Workload, workload
from pdserve.loadtest.serving_probe import ServingProbe
from pdserve.sim.calibrate import CPUAccount, Calibration, rel_error, serving_costs, serving_step
from pdserve.sim.cluster import Simulation
from pdserve.sim.config import ClusterSpec, SimRequest
from pdserve.sim.results import aggregate, median_aggregate
from pdserve.sim.scenario import batch_latency, cached_ttft, cluster_spec, idle_latency
from pdserve.sim.workload import requests_for

LATENCIES = (("ttft_p50_ms", "ttft_ms", "p50"), ("ttft_p90_ms", "ttft_ms", "p90"),
             ("tpot_p50_ms", "tpot_ms", "p50"), ("tpot_p90_ms", "tpot_ms", "p90"))
# a live run's router polls at an arbitrary phase of its arrivals; a prediction is the median over this
# many phases, evenly spaced over the poll period (one where placement reads no stats)
POLL_PHASES = 8
STATS_FREE = frozenset({"round_robin"})
FIT_SCALES = tuple(round(1.0 + 0.2 * k, 2) for k in range(11))  # 1.0 .. 3.0
MID_STEP_ARRIVALS = ("report", "counted", "unseen")
KV_PARTS_CHOICES = ("report", "on", "off")
# ClusterSpec.core_sharing, or "auto": continuous where the target's lowest rate has step counters and their
# wake-up wait is used (the continuous model's wait is measured there), step elsewhere
CORE_SHARING_CHOICES = ("step", "continuous", "auto")


def counts_arriving(report: dict[str, Any], mid_step_arrivals: str = "report") -> bool:
    """Whether the run's engines counted a request in their stats while it waited for a step in flight
    ("report": as the report's code did: only runs that name the feature in their provenance)."""
    if mid_step_arrivals not in MID_STEP_ARRIVALS:
        raise ValueError(f"mid-step arrivals {mid_step_arrivals!r}: one of {', '.join(MID_STEP_ARRIVALS)}")
    if mid_step_arrivals != "report":
        return mid_step_arrivals == "counted"
    return STATS_COUNT_ARRIVING in ((report.get("provenance") or {}).get("features") or ())


def hands_kv_in_parts(report: dict[str, Any], kv_parts: str = "report") -> bool:
    """Whether the run's router handed long prompts' KV to decode in parts (pdserve.sim.handoff): "report",
    runs that name the feature and runs dated from when it landed (the date format sorts as text); "on" or
    "off", a what-if."""
    if kv_parts not in KV_PARTS_CHOICES:
        raise ValueError(f"kv parts {kv_parts!r}: one of {', '.join(KV_PARTS_CHOICES)}")
    if kv_parts != "report":
        return kv_parts == "on"
    provenance = report.get("provenance") or {}
    return KV_PARTS in (provenance.get("features") or ()) or str(provenance.get("date") or "") >= KV_PARTS_SINCE


class Model:
    """One scenario's simulated runs: the report's configuration, a calibration per target."""

    def __init__(self, scenario: Scenario, report: dict[str, Any], profile: LatencyProfile,
                 serving_cores: float = 0.0, serving_cost: str = "counters", core_sharing: str = "auto",
                 poll_phases: int = POLL_PHASES, oversubscribed: tuple[float, float] = (1.0, 1.0),
                 mid_step_arrivals: str = "report", wake_wait: str = "measured", kv_parts: str = "report") -> None:
        if serving_cost not in ("counters", "step", "relay"):
            raise ValueError(f"serving cost {serving_cost!r}: 'counters' (the engines' step counters), 'step' "
                             "(the batch probe) or 'relay' (the idle probe)")
        if poll_phases < 1:
            raise ValueError(f"--poll-phases {poll_phases}: at least 1")
        if wake_wait not in ("measured", "off"):
            raise ValueError(f"wake wait {wake_wait!r}: 'measured' or 'off'")
        if core_sharing not in CORE_SHARING_CHOICES:
            raise ValueError(f"core sharing {core_sharing!r}: one of {', '.join(CORE_SHARING_CHOICES)}")
        self.poll_phases, self.oversubscribed, self.wake_wait = poll_phases, oversubscribed, wake_wait
        self.count_arriving = counts_arriving(report, mid_step_arrivals)
        self.kv_parts = hands_kv_in_parts(report, kv_parts)
        self.profile, self.report, self.serving_cost = profile, report, serving_cost
        self.core_sharing = core_sharing  # one of CORE_SHARING_CHOICES
        self.work: Workload = workload(report["workload"])
        ld = report["load"]
        self.load = LoadConfig(int(ld["num_requests"]), float(ld["max_duration_s"]), ld["arrival"],
                               float(ld.get("burstiness", 1.0)), scenario.seed)
        sw = report["sweep"]
        self.sweep = SweepConfig(tuple(sw["rates"]), int(sw["max_runs"]), float(sw["rel_tol"]),
                                 float(sw.get("target", 0.9)))
        self.slo = SLO(report["slo"]["ttft_ms"] / 1e3, report["slo"]["tpot_ms"] / 1e3)
        self.host_cores = ((report.get("provenance") or {}).get("host") or {}).get("cores")
        if serving_cores and not (self.host_cores and 0 <= serving_cores < self.host_cores):
            raise ValueError(f"--serving-cores {serving_cores:g}: needs a report with its host's cores, and "
                             f"0 <= cores < {self.host_cores}")
        self.num_cores = self.host_cores - serving_cores if self.host_cores else None

    def spec(self, target: dict[str, Any]) -> ClusterSpec:
        """The target's system on the report's host (every replica shares its cores), its engines' stats and
        its router's KV handoff as the run's code kept them."""
        spec = cluster_spec(target["system"], self.profile)
        engines = {role: dataclasses.replace(getattr(spec, role), stats_count_arriving=self.count_arriving)
                   for role in ("prefill", "decode")}
        router = spec.router if self.kv_parts else dataclasses.replace(spec.router, kv_part_tokens=None)
        return dataclasses.replace(spec, **engines, router=router, num_cores=self.num_cores,
                                   core_sharing=self.sharing(target), oversubscribed_scale=self.oversubscribed)

    def sharing(self, target: dict[str, Any]) -> str:
        """The target's ClusterSpec.core_sharing ("auto": continuous where its wake-up wait is measured)."""
        if self.core_sharing != "auto":
            return self.core_sharing
        low = min(target["points"], key=lambda p: p["rate"])
        measured = self.serving_cost == "counters" and self.wake_wait == "measured" and low.get("engine_steps")
        return "continuous" if measured else "step"

    def point(self, spec: ClusterSpec, cal: Calibration, rate: float) -> dict[str, Any]:
        return self.simulate(spec, cal, rate)[0]

    def simulate(self, spec: ClusterSpec, cal: Calibration, rate: float
                 ) -> tuple[dict[str, Any], dict[str, float], dict[str, dict[str, float]]]:
        """(the point's aggregates, CPU seconds of each role's replicas, each role's steps: Simulation.step_seconds),
        each the median over `poll_phases` phases of the routers' polls against the arrivals where placement
        reads the polls."""
        runs = self.phase_points(spec, cal, rate, self.poll_phases)
        steps = {role: {k: statistics.median(s[role][k] for *_, s in runs) for k in fields}
                 for role, fields in runs[0][2].items()}
        return (median_aggregate([point for point, *_ in runs]),
                {role: statistics.median(cpu[role] for _, cpu, _ in runs) for role in runs[0][1]}, steps)

    def phase_points(self, spec: ClusterSpec, cal: Calibration, rate: float, phases: int
                     ) -> list[tuple[dict[str, Any], dict[str, float], dict[str, dict[str, float]]]]:
        """(aggregates, CPU seconds of each role's replicas, each role's steps) at `phases` phases of the
        routers' polls, evenly spaced over the poll period; one where placement reads no stats."""
        requests = requests_for(self.work, self.load, rate, spec.decode.block_size)
        phases = 1 if spec.router.placement.policy in STATS_FREE else phases
        runs = []
        for i in range(phases):
            phased = dataclasses.replace(spec, router=dataclasses.replace(spec.router, poll_phase=i / phases))
            sim = Simulation(cal.spec(phased), cal.profile(self.profile), requests,
                             placement_profile=self.profile)
            runs.append((aggregate(cal.records(sim.run()), self.slo, rate, self.load.max_duration_s),
                         sim.cpu_seconds(), sim.step_seconds()))
        return runs

    def calibrate(self, spec: ClusterSpec, target: dict[str, Any], scales: tuple[float, float, float],
                  source: str, cached_scale: float | None = None) -> Calibration:
        cal = Calibration(*scales, source=source, prefill_cached_scale=cached_scale)
        low = min(target["points"], key=lambda p: p["rate"])
        account = CPUAccount.of(low, target.get("quiet_cpu_s"))
        counters = low.get("engine_steps") if self.serving_cost == "counters" else None
        batch = target.get("batch_probe") if self.serving_cost in ("counters", "step") and not counters else None
        batch = BatchProbe.from_dict(batch) if batch else None
        tokens = self.tokens(spec, low["rate"])
        probe = requests_for(self.work, LoadConfig(64, 1.0, "poisson", 1.0, PROBE_SEED), 1.0, spec.decode.block_size)
        live = target["idle"]
        probed = ServingProbe.from_dict(target["serving_probe"]) if target.get("serving_probe") else None
        for _ in range(3 if account else 1):  # each term moves the others' simulations: a fixed point
            if batch:  # the serving cost on every step: k requests decoding together, beyond the model's CPU
                b, host = batch.spec, cal.spec(spec)

                def probe_tpot(step_s: float, cal: Calibration = cal) -> float:
                    served = dataclasses.replace(cal, serving_step_s=step_s).profile(self.profile)
                    return batch_latency(host, served, b.k, b.prompt_len, b.output_len)

                cal = dataclasses.replace(cal, serving_step_s=serving_step(batch.tpot_s, probe_tpot))
            if counters:  # the engines' own steps at the lowest rate: their CPU, and the gaps between them
                cal = self.from_step_counters(spec, cal, low["rate"], counters)
            if probed:  # the serving path's TTFT, measured on its own
                cal = self.from_serving_probe(spec, cal, probed)
            sim = idle_latency(spec, dataclasses.replace(cal, relay_token_s=0.0).profile(self.profile), probe)
            ttft, relay = serving_costs(live["ttft_ms"] / 1e3, live["tpot_ms"] / 1e3, sim.ttft_s, sim.tpot_s)
            ttft = cal.serving_ttft_s if probed else ttft
            cal = dataclasses.replace(cal, serving_ttft_s=ttft, relay_token_s=0.0 if batch or counters else relay)
            if account is not None:
                _, modelled, _ = self.simulate(spec, cal, low["rate"])
                steps = sum(modelled.values()) - tokens * cal.off_step_cpu_token_s
                off_step, serving, background = account.costs(steps, tokens)
                cal = dataclasses.replace(cal, off_step_cpu_token_s=off_step, serving_cpu_token_s=serving,
                                          background_cores=background)
        return cal

    def from_step_counters(self, spec: ClusterSpec, cal: Calibration, rate: float,
                           live: dict[str, dict[str, float]]) -> Calibration:
        """From the live engines' step counters at `rate` (pdserve.loadtest.engine_steps): `serving_step_s`, the
        time between the decode engines' consecutive steps that was not a wait for a core, per gap (the engine
        loop's hand-offs and the streams' work; the simulator adds it to each decode step, where the host's
        sharing stretches it again); `wake_wait_s`, those gaps' wait for a core over the share of the steps'
        time spent waiting for one; and the decode and prefill scales times the live steps' CPU over the
        simulator's for the same point (decode-only steps, and steps that carried prompt tokens), which sets the
        profile's speed to the replicas' own under the run's load rather than an engine's alone in the
        machine check."""
        # the gaps of the decode role's engines (a prefill engine's can include waits for a handoff's pull)
        decoding = {"decode": live["decode"]} if "decode" in live else live
        gaps = sum(r.get("num_gaps", 0) for r in decoding.values())
        serving = sum(r["gap_s"] - r.get("gap_wait_s", 0.0) for r in decoding.values()) / gaps if gaps else 0.0
        _, _, simulated = self.simulate(spec, dataclasses.replace(cal, serving_step_s=0.0), rate)

        def cpu(steps: Mapping[str, Mapping[str, float]], prefill: bool) -> float:
            return sum(r.get("prefill_step_cpu_s", 0.0) if prefill else r["step_cpu_s"] - r.get("prefill_step_cpu_s", 0.0)
                       for r in steps.values())

        k_decode = cpu(live, False) / cpu(simulated, False) if cpu(simulated, False) > 0 and cpu(live, False) > 0 else 1.0
        k_prefill = cpu(live, True) / cpu(simulated, True) if cpu(simulated, True) > 0 and cpu(live, True) > 0 else 1.0
        cached = None if cal.prefill_cached_scale is None else cal.prefill_cached_scale * k_prefill
        # the gaps' wait for a core, over the share of its steps' time the stepping threads waited for one: what
        # a woken thread waits where every core is taken (ClusterSpec.wake_wait_s)
        wall = sum(r["step_s"] for r in decoding.values())
        waited = sum(r.get("step_wait_s", 0.0) for r in decoding.values()) / wall if wall > 0 else 0.0
        gap_wait = sum(r.get("gap_wait_s", 0.0) for r in decoding.values()) / gaps if gaps else 0.0
        wake = gap_wait / waited if waited > 0.02 and self.wake_wait == "measured" else 0.0  # an idle host's few
        # waits say nothing of a busy one
        return dataclasses.replace(cal, serving_step_s=max(0.0, serving), wake_wait_s=wake,
                                   decode_fixed_scale=cal.decode_fixed_scale * k_decode,
                                   decode_row_scale=cal.decode_row_scale * k_decode,
                                   prefill_scale=cal.prefill_scale * k_prefill, prefill_cached_scale=cached)

    def from_serving_probe(self, spec: ClusterSpec, cal: Calibration, serving: ServingProbe) -> Calibration:
        """`serving_ttft_s`: the probe's short TTFT less the simulator's for that request; `serving_ttft_token_s`:
        its cached sends' TTFT beyond that and the simulator's, per prompt token. The prefill's speed stays the
        machine check's (re-timing it from the idle probe or the cold sends moved the worst errors the wrong
        way: docs/simulator.md)."""
        bare = dataclasses.replace(cal, relay_token_s=0.0).profile(self.profile)
        short = SimRequest(0, 0.0, serving.spec.prompt_len, max(2, serving.spec.output_len))
        fixed = max(0.0, serving.ttft_s - idle_latency(spec, bare, [short]).ttft_s)
        per_token = 0.0
        if cached := serving.cached:
            n = serving.spec.cached_len
            per_token = max(0.0, cached[0] - fixed - cached_ttft(spec, bare, n, cached[1])) / n
        return dataclasses.replace(cal, serving_ttft_s=fixed, serving_ttft_token_s=per_token)

    def tokens(self, spec: ClusterSpec, rate: float) -> int:
        return sum(r.output_tokens for r in requests_for(self.work, self.load, rate, spec.decode.block_size))

    def fit_scales(self, target: dict[str, Any]) -> tuple[tuple[float, float, float], float]:
        """((prefill, decode, decode) scales, error): on a grid, the pair whose calibration best fits the
        target's lowest-rate point (its largest relative error over TTFT and TPOT p50/p90)."""
        spec, low = self.spec(target), min(target["points"], key=lambda p: p["rate"])
        best: tuple[tuple[float, float, float], float] = ((1.0, 1.0, 1.0), float("inf"))
        for p, d in itertools.product(FIT_SCALES, FIT_SCALES):
            cal = self.calibrate(spec, target, (p, d, d), "fit")
            figures = compare(self.point(spec, cal, low["rate"]), low["summary"])
            error = max(rel_error(f["predicted"], f["measured"]) for f in figures.values())
            if error < best[1]:
                best = ((p, d, d), error)
        return best


def compare(predicted: dict[str, Any], summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    out = {}
    for name, key, pct in LATENCIES:
        measured = (summary.get(key) or {}).get(pct)
        value = predicted.get(name.replace("_ms", "_s"))
        if measured is not None and value is not None:
            out[name] = {"predicted": value * 1e3, "measured": float(measured)}
    return out
