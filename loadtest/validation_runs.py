"""Several live runs of one scenario, validated together: each run's report is validated on its own (its own
machine check, idle probe and CPU calibration), then each figure's predictions and measurements are put
side by side as a median with its range. A measured range wider than the ±20% target says the target is
below what the live system repeats to."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from pdserve.loadtest.validate import TARGET_ERROR
from pdserve.sim.calibrate import rel_error


def report_paths(results: Path) -> list[Path]:
    """`results/run-*/summary.json` when there are such runs, else `results/summary.json`."""
    runs = sorted(results.glob("run-*/summary.json"))
    return runs or [results / "summary.json"]


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
                                         "calibration", "replica_cpu_model_share", "host_cpu_model_share")}
                 for r in runs],
        "profile": runs[0].get("profile"), "seed": runs[0].get("seed"), "num_cores": runs[0].get("num_cores"),
        "serving_cores": runs[0].get("serving_cores"), "replica_thread_factors": runs[0].get("replica_thread_factors"),
    }
