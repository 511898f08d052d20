"""`pdserve-loadtest validate`: the simulator (pdserve.sim) against a committed live report.

Each target of `loadtest/results/<scenario>/summary.json` is simulated as that run was configured: the
report's own target systems, workload, load, sweep and resolved SLOs, the scenario YAML's seed (the report
does not record it), and the latency profile its routers or machine check named. The profile is calibrated
(pdserve.sim.calibrate) from idle measurements only:

- CPU scales from the target's machine check (the scenario's when the target has none); a report without
  any (router-policies) gets one scale for every coefficient, the one that best fits its reference target's
  lowest-rate point, and that point is then left out of the comparison;
- the serving layer's time per decode step from the target's batch probe (k requests decoding together),
  and its TTFT delay from the idle probe; reports without a batch probe, or `--serving-cost relay`, get a
  per-token relay cost from the idle probe's TPOT instead.

Then every measured sweep point (TTFT p50/p90, TPOT p50/p90, in ms) and each target's goodput are predicted
and put beside the measured figure. The goodput figure is read where SLO attainment crosses the target,
between the rates tried (pdserve.loadtest.goodput_ratio.crossing), on both sides; the sweep grid's own
goodput (the highest passing rate, which on a grid 1.5x apart can only differ by 33% or more) is reported
beside the figures (`grid_figures`) and not counted in them.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pdserve.latency_model import LatencyProfile
from pdserve.loadtest.batch_probe import BatchProbe
from pdserve.loadtest.evaluate import PROBE_SEED
from pdserve.loadtest.goodput_ratio import crossing_figure
from pdserve.loadtest.machine import replica_threads
from pdserve.loadtest.machine_threads import with_thread_factors
from pdserve.loadtest.runner import LoadConfig
from pdserve.loadtest.scenario import Scenario
from pdserve.loadtest.slo import SLO
from pdserve.loadtest.sweep import SweepConfig, find_goodput
from pdserve.loadtest.workloads import Workload, workload
from pdserve.sim.calibrate import (
    CPUAccount, Calibration, cached_prefill_scale, rel_error, scales_from_machine, serving_costs, serving_step,
)
from pdserve.sim.cluster import Simulation
from pdserve.sim.config import ClusterSpec
from pdserve.sim.results import aggregate, median_aggregate
from pdserve.sim.scenario import batch_latency, cluster_spec, idle_latency, load_profile
from pdserve.sim.workload import requests_for

TARGET_ERROR = 0.2
LATENCIES = (("ttft_p50_ms", "ttft_ms", "p50"), ("ttft_p90_ms", "ttft_ms", "p90"),
             ("tpot_p50_ms", "tpot_ms", "p50"), ("tpot_p90_ms", "tpot_ms", "p90"))
# a live run's router polls at an arbitrary phase of its arrivals; a prediction is the median over this
# many phases, evenly spaced over the poll period (one where placement reads no stats)
POLL_PHASES = 8
STATS_FREE = frozenset({"round_robin"})
FIT_SCALES = tuple(round(1.0 + 0.2 * k, 2) for k in range(11))  # 1.0 .. 3.0


def load_report(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read report {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    missing = [k for k in ("workload", "load", "sweep", "slo", "targets") if k not in report]
    if missing or not all("idle" in t and "points" in t and "system" in t for t in report.get("targets", [])):
        raise ValueError(f"{path}: not a scenario report (missing {missing or 'targets[].idle/points/system'})")
    return report


def load_scenario(arg: str) -> Scenario:
    """A scenario YAML, or a committed scenario's name (loadtest/scenarios/NAME.yaml)."""
    import yaml

    path = Path(arg) if arg.endswith((".yaml", ".yml")) else Path("loadtest/scenarios") / f"{arg}.yaml"
    try:
        return Scenario.from_yaml(path)
    except OSError as exc:
        raise ValueError(f"cannot read scenario {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML ({str(exc).splitlines()[0]})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not a scenario ({str(exc).splitlines()[0]})") from None


class Model:
    """One scenario's simulated runs: the report's configuration, a calibration per target."""

    def __init__(self, scenario: Scenario, report: dict[str, Any], profile: LatencyProfile,
                 serving_cores: float = 0.0, serving_cost: str = "step", core_sharing: str = "step",
                 poll_phases: int = POLL_PHASES, oversubscribed: tuple[float, float] = (1.0, 1.0)) -> None:
        if serving_cost not in ("step", "relay"):
            raise ValueError(f"serving cost {serving_cost!r}: 'step' (the batch probe) or 'relay' (the idle probe)")
        if poll_phases < 1:
            raise ValueError(f"--poll-phases {poll_phases}: at least 1")
        self.poll_phases, self.oversubscribed = poll_phases, oversubscribed
        self.profile, self.report, self.serving_cost = profile, report, serving_cost
        self.core_sharing = core_sharing  # ClusterSpec.core_sharing: "step" or "continuous"
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
        """The target's system on the report's host: every replica shares its cores."""
        return dataclasses.replace(cluster_spec(target["system"], self.profile), num_cores=self.num_cores,
                                   core_sharing=self.core_sharing, oversubscribed_scale=self.oversubscribed)

    def point(self, spec: ClusterSpec, cal: Calibration, rate: float) -> dict[str, Any]:
        return self.simulate(spec, cal, rate)[0]

    def simulate(self, spec: ClusterSpec, cal: Calibration, rate: float) -> tuple[dict[str, Any], dict[str, float]]:
        """(the point's aggregates, CPU seconds of each role's engine steps), each the median over
        `poll_phases` phases of the routers' polls against the arrivals where placement reads the polls."""
        runs = self.phase_points(spec, cal, rate, self.poll_phases)
        return (median_aggregate([point for point, _ in runs]),
                {role: statistics.median(cpu[role] for _, cpu in runs) for role in runs[0][1]})

    def phase_points(self, spec: ClusterSpec, cal: Calibration, rate: float, phases: int
                     ) -> list[tuple[dict[str, Any], dict[str, float]]]:
        """(aggregates, CPU seconds of each role's steps) at `phases` phases of the routers' polls, evenly
        spaced over the poll period; one where placement reads no stats."""
        requests = requests_for(self.work, self.load, rate, spec.decode.block_size)
        phases = 1 if spec.router.placement.policy in STATS_FREE else phases
        runs = []
        for i in range(phases):
            phased = dataclasses.replace(spec, router=dataclasses.replace(spec.router, poll_phase=i / phases))
            sim = Simulation(cal.spec(phased), cal.profile(self.profile), requests,
                             placement_profile=self.profile)
            runs.append((aggregate(cal.records(sim.run()), self.slo, rate, self.load.max_duration_s),
                         sim.cpu_seconds()))
        return runs

    def calibrate(self, spec: ClusterSpec, target: dict[str, Any], scales: tuple[float, float, float],
                  source: str, cached_scale: float | None = None) -> Calibration:
        cal = Calibration(*scales, source=source, prefill_cached_scale=cached_scale)
        low = min(target["points"], key=lambda p: p["rate"])
        account = CPUAccount.of(low, target.get("quiet_cpu_s"))
        batch = target.get("batch_probe") if self.serving_cost == "step" else None
        batch = BatchProbe.from_dict(batch) if batch else None
        tokens = self.tokens(spec, low["rate"])
        probe = requests_for(self.work, LoadConfig(64, 1.0, "poisson", 1.0, PROBE_SEED), 1.0, spec.decode.block_size)
        live = target["idle"]
        for _ in range(3 if account else 1):  # each term moves the others' simulations: a fixed point
            if batch:  # the serving cost on every step: k requests decoding together, beyond the model's CPU
                b, host = batch.spec, cal.spec(spec)

                def probe_tpot(step_s: float, cal: Calibration = cal) -> float:
                    served = dataclasses.replace(cal, serving_step_s=step_s).profile(self.profile)
                    return batch_latency(host, served, b.k, b.prompt_len, b.output_len)

                cal = dataclasses.replace(cal, serving_step_s=serving_step(batch.tpot_s, probe_tpot))
            sim = idle_latency(spec, dataclasses.replace(cal, relay_token_s=0.0).profile(self.profile), probe)
            ttft, relay = serving_costs(live["ttft_ms"] / 1e3, live["tpot_ms"] / 1e3, sim.ttft_s, sim.tpot_s)
            cal = dataclasses.replace(cal, serving_ttft_s=ttft, relay_token_s=0.0 if batch else relay)
            if account is not None:
                _, modelled = self.simulate(spec, cal, low["rate"])
                steps = sum(modelled.values()) - tokens * cal.off_step_cpu_token_s
                off_step, serving, background = account.costs(steps, tokens)
                cal = dataclasses.replace(cal, off_step_cpu_token_s=off_step, serving_cpu_token_s=serving,
                                          background_cores=background)
        return cal

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


def compare_cpu(replicas_s: float, tokens: int, cal: Calibration, account: CPUAccount) -> dict[str, float]:
    """The replicas' CPU in the model (their steps and off-step work, plus their quiet rate over the live
    point's duration) beside the measured; and the host's, where the report measured it."""
    d = account.duration_s
    model = replicas_s + account.quiet_replica_cores * d
    out = {"predicted_s": model, "measured_s": account.replicas_s,
           "model_share": model / account.replicas_s if account.replicas_s else 0.0}
    if account.host_s is not None:
        rest = cal.background_cores - account.quiet_replica_cores if account.quiet_host_cores is not None else 0.0
        host = model + cal.serving_cpu_token_s * tokens + rest * d
        out |= {"host_predicted_s": host, "host_measured_s": account.host_s,
                "host_model_share": host / account.host_s if account.host_s else 0.0}
    return out


def cpu_summary(replica_cpu: dict[str, dict[str, float]]) -> dict[str, Any]:
    if not replica_cpu:
        return {}
    shares = [v["model_share"] for v in replica_cpu.values()]
    out = {"replica_cpu": replica_cpu, "replica_cpu_model_share": {"min": min(shares), "max": max(shares)}}
    if host := [v["host_model_share"] for v in replica_cpu.values() if "host_model_share" in v]:
        out["host_cpu_model_share"] = {"min": min(host), "max": max(host)}
    return out


def _profile_path(scenario: Scenario, report: dict[str, Any]) -> str:
    for check in report.get("machine") or ():
        return check["profile_path"]
    for target in report["targets"]:
        path = (target["system"].get("router") or {}).get("profile_path")
        if path:
            return path
    if scenario.machine_profile:
        return scenario.machine_profile
    raise ValueError(f"report {report.get('scenario')!r} and its scenario name no latency profile")


def validate(scenario: Scenario, report_path: Path, profile_path: str | None = None,
             serving_cores: float = 0.0, thread_factors: Mapping[str, float] | None = None,
             replica_threads_n: int | None = None, serving_cost: str = "step", core_sharing: str = "step",
             poll_phases: int = POLL_PHASES, contention: Mapping[str, float] | None = None,
             observe: Callable[[Model, dict[str, Any], ClusterSpec, Calibration], None] | None = None
             ) -> dict[str, Any]:
    """scenario name -> {max_abs_rel_error, figures: {name: {predicted, measured}}, calibration, ...}.
    `thread_factors`: the what-if of pdserve.loadtest.machine_threads, each machine check scaled by them;
    with `replica_threads_n`, only the checks of targets whose replicas all run that many threads.
    `observe(model, target, spec, calibration)` is called once per target, calibrated."""
    report = load_report(report_path)
    path = profile_path or _profile_path(scenario, report)
    profile = load_profile(path)
    oversubscribed = (contention["prefill"], contention["decode"]) if contention else (1.0, 1.0)
    model = Model(scenario, report, profile, serving_cores, serving_cost, core_sharing, poll_phases,
                  oversubscribed)
    targets = report["targets"]
    fitted: tuple[tuple[float, float, float], float] | None = None
    if not any(t.get("machine") for t in targets) and not report.get("machine"):
        fitted = model.fit_scales(targets[0])
    figures: dict[str, dict[str, Any]] = {}
    grid: dict[str, dict[str, float]] = {}  # the sweep grid's goodput, beside the figures, not among them
    calibrations: dict[str, Any] = {}
    left_out: list[str] = []
    replica_cpu: dict[str, dict[str, float]] = {}
    for i, target in enumerate(targets):
        name, spec = target["name"], model.spec(target)
        checks = target.get("machine") or report.get("machine")
        if checks:
            scaled = thread_factors and (replica_threads_n is None or
                                         set(replica_threads(target["system"]).values()) == {replica_threads_n})
            check = with_thread_factors(checks[0], thread_factors) if scaled else checks[0]
            scales, source = scales_from_machine(check, profile), "machine check"
            cached = cached_prefill_scale(check, profile, scales[0])
        else:
            scales, source = fitted[0], f"fit to {targets[0]['name']}'s lowest rate"  # type: ignore[index]
            cached = None
        cal = model.calibrate(spec, target, scales, source, cached)
        calibrations[name] = {**cal.to_dict(), "idle_measured_ms": target["idle"]}
        if observe is not None:
            observe(model, target, spec, cal)
        lowest = min(p["rate"] for p in target["points"])
        for point in sorted(target["points"], key=lambda p: p["rate"]):
            rate = point["rate"]
            if fitted is not None and i == 0 and rate == lowest:
                left_out.append(f"{name}/{rate:.3g}")
                continue
            predicted, cpu = model.simulate(spec, cal, rate)
            for fig, value in compare(predicted, point["summary"]).items():
                figures[f"{name}/{rate:.3g}/{fig}"] = value
            if account := CPUAccount.of(point, target.get("quiet_cpu_s")):
                replica_cpu[f"{name}/{rate:.3g}"] = compare_cpu(sum(cpu.values()), model.tokens(spec, rate),
                                                                 cal, account)

        def attainment(rate: float, spec: ClusterSpec = spec, cal: Calibration = cal) -> float:
            return model.point(spec, cal, rate)["slo_attainment"]

        sim = find_goodput(attainment, model.sweep)
        figures[f"{name}/goodput_rps"] = crossing_figure(sim.points, target["points"], model.sweep.target)
        grid[f"{name}/grid_goodput_rps"] = {"predicted": sim.goodput, "measured": float(target["goodput"])}
    for v in (*figures.values(), *grid.values()):
        v["rel_error"] = rel_error(v["predicted"], v["measured"])
    errors = {k: v["rel_error"] for k, v in figures.items()}
    worst = max(errors.values(), default=0.0)
    return {
        "max_abs_rel_error": worst, "within_target": worst <= TARGET_ERROR,
        "num_figures": len(figures), "num_within_target": sum(e <= TARGET_ERROR for e in errors.values()),
        "figures": figures, "grid_figures": grid, "calibration": calibrations, **cpu_summary(replica_cpu),
        "calibrated_on": "idle probes" + (
            f"; no machine check in the report: prefill and decode scales {fitted[0][0]:g} and {fitted[0][1]:g} "
            f"fitted on {', '.join(left_out)} (left out of the figures)" if fitted else " and machine checks"),
        "num_cores": model.num_cores, "serving_cores": serving_cores, "serving_cost": serving_cost,
        "core_sharing": core_sharing, "poll_phases": poll_phases, "contention": contention,
        "replica_thread_factors": thread_factors,
        "report": str(report_path), "report_commit": (report.get("provenance") or {}).get("commit"),
        "profile": path, "seed": scenario.seed,
    }
