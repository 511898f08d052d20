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

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pdserve.loadtest.goodput_ratio import crossing_figure
from pdserve.loadtest.machine import replica_threads
from pdserve.loadtest.machine_threads import with_thread_factors
from pdserve.loadtest.scenario import Scenario
from pdserve.loadtest.sweep import find_goodput
from pdserve.loadtest.validation_model import POLL_PHASES, Model, compare
from pdserve.sim.calibrate import CPUAccount, Calibration, cached_prefill_scale, rel_error, scales_from_machine
from pdserve.sim.config import ClusterSpec
from pdserve.sim.scenario import load_profile

TARGET_ERROR = 0.2
# what each point is simulated with: the calibration at its target's lowest rate (a prediction), or one from the
# point's own measurements (what-if: the model's structure apart from how its terms move with the load)
CALIBRATE_ON = ("lowest", "each")


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


def compare_steps(predicted: Mapping[str, Mapping[str, float]], measured: Mapping[str, Any]) -> dict[str, Any]:
    """Role -> the simulator's steps beside the live engines' (pdserve.loadtest.engine_steps): counts, wall and
    CPU seconds, and the wall over CPU (`stretch`); live, the wall's share waiting for a core and the rest
    (`blocked_share`: the GIL, locks), and the gaps between steps, which the simulator does not have."""
    out = {}
    for role, live in measured.items():
        sim = predicted.get(role)
        if not sim or not live.get("num_steps") or not live.get("step_cpu_s"):
            continue
        wall, cpu, wait = live["step_s"], live["step_cpu_s"], live["step_wait_s"]
        out[role] = {
            "predicted": {**sim, "stretch": sim["step_s"] / sim["step_cpu_s"] if sim["step_cpu_s"] else None},
            "measured": {k: v for k, v in live.items() if k not in ("replicas", "each", "unmatched")}
            | {"stretch": wall / cpu, "wait_share": wait / wall, "blocked_share": max(0.0, wall - cpu - wait) / wall},
        }
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
             replica_threads_n: int | None = None, serving_cost: str = "counters", core_sharing: str = "auto",
             poll_phases: int = POLL_PHASES, contention: Mapping[str, float] | None = None,
             observe: Callable[[Model, dict[str, Any], ClusterSpec, Calibration], None] | None = None,
             mid_step_arrivals: str = "report", wake_wait: str = "measured", kv_parts: str = "report",
             calibrate_on: str = "lowest") -> dict[str, Any]:
    """scenario name -> {max_abs_rel_error, figures: {name: {predicted, measured}}, calibration, ...}.
    `thread_factors`: the what-if of pdserve.loadtest.machine_threads, each machine check scaled by them;
    with `replica_threads_n`, only the checks of targets whose replicas all run that many threads.
    `observe(model, target, spec, calibration)` is called once per target, calibrated. `mid_step_arrivals`:
    whether the engines' stats showed a request waiting for a step in flight (pdserve.loadtest.validation_model).
    `calibrate_on`: "each" simulates every point with a calibration from that point alone (goodput keeps the
    lowest rate's)."""
    if calibrate_on not in CALIBRATE_ON:
        raise ValueError(f"calibrate on {calibrate_on!r}: one of {', '.join(CALIBRATE_ON)}")
    report = load_report(report_path)
    contention = contention or report.get("contention")  # measured here (a what-if), else the run's own
    path = profile_path or _profile_path(scenario, report)
    profile = load_profile(path)
    oversubscribed = (contention["prefill"], contention["decode"]) if contention else (1.0, 1.0)
    model = Model(scenario, report, profile, serving_cores, serving_cost, core_sharing, poll_phases,
                  oversubscribed, mid_step_arrivals, wake_wait, kv_parts)
    targets = report["targets"]
    fitted: tuple[tuple[float, float, float], float] | None = None
    if not any(t.get("machine") for t in targets) and not report.get("machine"):
        fitted = model.fit_scales(targets[0])
    figures: dict[str, dict[str, Any]] = {}
    grid: dict[str, dict[str, float]] = {}  # the sweep grid's goodput, beside the figures, not among them
    calibrations: dict[str, Any] = {}
    left_out: list[str] = []
    replica_cpu: dict[str, dict[str, float]] = {}
    engine_steps: dict[str, dict[str, Any]] = {}
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
            own = cal
            if calibrate_on == "each" and rate != lowest:
                own = model.calibrate(spec, {**target, "points": [point]}, scales, source, cached)
                calibrations[name].setdefault("each_point", {})[f"{rate:.3g}"] = own.to_dict()
            predicted, cpu, steps = model.simulate(spec, own, rate)
            if point.get("engine_steps") and (stepped := compare_steps(steps, point["engine_steps"])):
                engine_steps[f"{name}/{rate:.3g}"] = stepped
            for fig, value in compare(predicted, point["summary"]).items():
                figures[f"{name}/{rate:.3g}/{fig}"] = value
            if account := CPUAccount.of(point, target.get("quiet_cpu_s")):
                replica_cpu[f"{name}/{rate:.3g}"] = compare_cpu(sum(cpu.values()), model.tokens(spec, rate),
                                                                 own, account)

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
        **({"engine_steps": engine_steps} if engine_steps else {}),
        "calibrated_on": "idle probes" + (
            f"; no machine check in the report: prefill and decode scales {fitted[0][0]:g} and {fitted[0][1]:g} "
            f"fitted on {', '.join(left_out)} (left out of the figures)" if fitted else " and machine checks"),
        "num_cores": model.num_cores, "serving_cores": serving_cores, "serving_cost": serving_cost,
        "core_sharing": core_sharing, "poll_phases": poll_phases, "contention": contention,
        "stats_count_arriving": model.count_arriving, "wake_wait": wake_wait, "calibrate_on": calibrate_on,
        "replica_thread_factors": thread_factors,
        "report": str(report_path), "report_commit": (report.get("provenance") or {}).get("commit"),
        "profile": path, "seed": scenario.seed,
    }
