"""`pdserve-loadtest validate`'s driver (scenarios, their reports, --write), and several live runs of one
scenario validated together: each run's report is validated on its own (its own
machine check, idle probe and CPU calibration), then each figure's predictions and measurements are put
side by side as a median with its range. A measured range wider than the ±20% target says the target is
below what the live system repeats to."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from pdserve.loadtest.contention import engines_per_host
from pdserve.loadtest.contention import measure as measure_contention
from pdserve.loadtest.machine_threads import thread_factors
from pdserve.loadtest.models import resolve_model
from pdserve.loadtest.validate import TARGET_ERROR, load_report, load_scenario, validate
from pdserve.loadtest.validation_ceiling import RunPhases, ceiling
from pdserve.loadtest.validation_model import POLL_PHASES
from pdserve.loadtest.validation_replication import replication as replicate
from pdserve.loadtest.validation_sensitivity import RunSpeeds, sensitivity
from pdserve.sim.calibrate import rel_error


def report_paths(results: Path) -> list[Path]:
    """`results/run-*/summary.json` when there are such runs, else `results/summary.json`."""
    runs = sorted(results.glob("run-*/summary.json"))
    return runs or [results / "summary.json"]


def all_report_paths(results: Path) -> list[Path]:
    """Every live run under `results`: each set of repeated runs (`run-*/summary.json` at any depth), in order."""
    return sorted(results.glob("**/run-*/summary.json"))


def load_reports(results: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The reports of `results` (`report_paths`), parsed; a ValueError naming the directory or the file."""
    paths = [p for p in report_paths(results) if p.exists()]
    if not paths:
        raise ValueError(f"{results}: no summary.json, nor run-*/summary.json")
    reports = []
    for path in paths:
        try:
            reports.append((path, json.loads(path.read_text(encoding="utf-8"))))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc.msg})") from None
    return reports


def combined(runs: list[dict[str, Any]], part: str) -> dict[str, dict[str, Any]]:
    """Per figure of `part`: the median prediction against the median measurement, both ranges, the measured
    spread (half its range over its median), and each run's bounds where the figure has them."""
    figures: dict[str, dict[str, Any]] = {}
    for key in (runs[0].get(part) or {}):
        pairs = [r[part][key] for r in runs if key in (r.get(part) or {})]
        measured, predicted = [p["measured"] for p in pairs], [p["predicted"] for p in pairs]
        mid_m, mid_p = statistics.median(measured), statistics.median(predicted)
        figures[key] = {
            "predicted": mid_p, "measured": mid_m, "rel_error": rel_error(mid_p, mid_m),
            "measured_range": [min(measured), max(measured)], "predicted_range": [min(predicted), max(predicted)],
            "measured_spread": (max(measured) - min(measured)) / 2 / mid_m if mid_m else 0.0,
            "within_measured_range": min(measured) <= mid_p <= max(measured), "repetitions": len(pairs),
            **{k: [p[k] for p in pairs] for k in pairs[0] if k.endswith("_bound")}}
    return figures


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One scenario's validations, one per live run, as one: per figure the median prediction against the
    median measurement, with both ranges; the measured spread (half the range over the median) per figure."""
    if len(runs) == 1:
        return runs[0]
    figures, grid = combined(runs, "figures"), combined(runs, "grid_figures")
    errors = [f["rel_error"] for f in figures.values()]
    spreads = [f["measured_spread"] for f in figures.values()]
    worst = max(errors, default=0.0)
    return {
        "max_abs_rel_error": worst, "within_target": worst <= TARGET_ERROR, "num_figures": len(figures),
        "num_within_target": sum(e <= TARGET_ERROR for e in errors),
        "num_within_measured_range": sum(f["within_measured_range"] for f in figures.values()),
        "num_measured_spread_over_target": sum(s > TARGET_ERROR for s in spreads),
        "max_measured_spread": max(spreads, default=0.0), "repetitions": len(runs), "figures": figures,
        "grid_figures": grid,
        "runs": [{k: r.get(k) for k in ("report", "report_commit", "max_abs_rel_error", "num_within_target",
                                         "calibration", "replica_cpu_model_share", "host_cpu_model_share",
                                         "engine_steps")}
                 for r in runs],
        "profile": runs[0].get("profile"), "seed": runs[0].get("seed"), "num_cores": runs[0].get("num_cores"),
        "serving_cores": runs[0].get("serving_cores"), "serving_cost": runs[0].get("serving_cost"),
        "core_sharing": runs[0].get("core_sharing"), "poll_phases": runs[0].get("poll_phases"),
        "contention": runs[0].get("contention"), "stats_count_arriving": runs[0].get("stats_count_arriving"),
        "wake_wait": runs[0].get("wake_wait"), "calibrate_on": runs[0].get("calibrate_on"),
        "replica_thread_factors": runs[0].get("replica_thread_factors"),
    }


def validate_main(names: list[str], reports: list[str] | None, profile: str | None, write: Path | None,
                  serving_cores: float = 0.0, replica_threads: int | None = None,
                  serving_cost: str = "counters", core_sharing: str = "auto", poll_phases: int = POLL_PHASES,
                  contention: bool = False, noise_ceiling: bool = False,
                  mid_step_arrivals: str = "report", wake_wait: str = "measured", kv_parts: str = "report",
                  all_runs: bool = False, calibrate_on: str = "lowest", speed_sensitivity: bool = False,
                  replication: bool = False) -> dict[str, Any]:
    """`reports`: one scenario's live reports (several: repeated runs, combined); default
    loadtest/results/<name>/run-*/summary.json, else loadtest/results/<name>/summary.json.
    `replica_threads`: the what-if of pdserve.loadtest.machine_threads, measured here per scenario's model;
    `contention`: that of pdserve.loadtest.contention, for scenarios whose engines over-subscribe the host;
    `noise_ceiling`: each scenario's `noise_ceiling` (pdserve.loadtest.validation_ceiling) beside its figures.
    `all_runs`: every set of runs under loadtest/results/<name> (`all_report_paths`), pooled.
    `speed_sensitivity`: each scenario's `speed_sensitivity` (pdserve.loadtest.validation_sensitivity).
    `replication`: each scenario's `replication` (pdserve.loadtest.validation_replication); two sets or more."""
    if reports and len(names) != 1:
        raise ValueError("--report goes with exactly one scenario")
    if reports and all_runs:
        raise ValueError("--report and --all-runs: choose one")
    out: dict[str, Any] = {}
    measured: dict[str, dict[str, float]] = {}
    shared: dict[tuple[str, int, float], dict[str, float]] = {}
    for arg in names:
        scenario = load_scenario(arg)
        results = Path("loadtest/results") / scenario.name
        paths = ([Path(r) for r in reports] if reports else
                 all_report_paths(results) if all_runs else report_paths(results))
        if all_runs and not paths:
            raise ValueError(f"{results}: no run-*/summary.json at any depth")
        factors = None
        if replica_threads is not None:
            model = resolve_model(scenario.model)
            if model not in measured:  # scenarios sharing a model share one measurement
                measured[model] = thread_factors(model, replica_threads)
            factors = measured[model]
        slowdown = None
        if contention and paths:
            report = load_report(paths[0])
            key = (resolve_model(scenario.model), engines_per_host(report),
                   float(((report.get("provenance") or {}).get("host") or {}).get("cores") or 0))
            if key[2] and key[1] > key[2]:  # more engines than cores; scenarios alike share one measurement
                if key not in shared:
                    shared[key] = measure_contention(*key)
                slowdown = shared[key]
        if replication and len({p.parent.parent for p in paths}) < 2:
            raise ValueError(f"{scenario.name}: --replication needs runs from at least two sets (directories "
                             "holding run-*/); give them with --report or --all-runs")
        runs, phased, speeds = [], [], []
        for path in paths:
            observers = [o for o, on in ((RunPhases(), noise_ceiling), (RunSpeeds(), speed_sensitivity)) if on]

            def observe(*args: Any, observers: list[Any] = observers) -> None:
                for o in observers:
                    o(*args)

            runs.append(validate(scenario, path, profile, serving_cores, factors, replica_threads, serving_cost,
                                 core_sharing, poll_phases, slowdown, observe if observers else None,
                                 mid_step_arrivals, wake_wait, kv_parts, calibrate_on=calibrate_on))
            for o in observers:
                if isinstance(o, RunPhases):
                    o.predicted = {k: v["predicted"] for k, v in runs[-1]["figures"].items()}
                    phased.append(o)
                else:
                    speeds.append(o)
        out[scenario.name] = combine(runs)
        if phased:
            out[scenario.name]["noise_ceiling"] = ceiling(phased, phased[0].goal)
        if speeds:
            out[scenario.name]["speed_sensitivity"] = sensitivity(speeds)
        if replication:
            out[scenario.name]["replication"] = replicate(paths, runs)
    if write is not None:
        existing: dict[str, Any] = {}
        if write.exists():
            try:
                existing = json.loads(write.read_text(encoding="utf-8"))
            except json.JSONDecodeError:
                raise ValueError(f"{write}: not JSON; remove it or write elsewhere") from None
        write.write_text(json.dumps({**existing, **out}, indent=1) + "\n", encoding="utf-8")
    return out
