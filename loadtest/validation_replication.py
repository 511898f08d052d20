"""`pdserve-loadtest validate --replication`: the model against each set of repeated live runs, beside the live
experiment repeated.

A set is the runs of one directory (`.../<set>/run-*/summary.json`), run one after another within an hour. Two
comparisons, each scored the same way (figures within ±20%, the worst error):

- per set, its median measurements predicted by the model (the median of its predictions for the set's runs,
  each calibrated on its own run, as `validate --report` gives) and by the other sets' median measurements
  (the same scenario on the same live system, hours or days apart: how far the live figures move between sets);
- per run, its measurements predicted by the model's prediction for that run and by the median of the other
  runs of its set (minutes apart: the noise no calibration made before a run can remove).

The repeated live runs need no model: where they predict a run or a set on no more figures than the model does,
the ±20% target asks more than the live system repeats to on this host.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.loadtest.validate import TARGET_ERROR
from pdserve.sim.calibrate import rel_error


def set_name(report: Path) -> str:
    """The directory holding a run's `run-*` directory: `.../counters-2/run-1/summary.json` -> `counters-2`."""
    return report.parent.parent.name


def score(errors: Mapping[str, float]) -> dict[str, Any]:
    return {"num_within_target": sum(e <= TARGET_ERROR for e in errors.values()),
            "max_abs_rel_error": max(errors.values(), default=0.0), "num_figures": len(errors)}


def _medians(runs: Sequence[Mapping[str, Any]], field: str) -> dict[str, float]:
    values: dict[str, list[float]] = {}
    for run in runs:
        for key, figure in run["figures"].items():
            values.setdefault(key, []).append(figure[field])
    return {key: statistics.median(v) for key, v in values.items()}


def _scored(guess: Mapping[str, float], measured: Mapping[str, float]) -> dict[str, Any]:
    return score({k: rel_error(guess[k], measured[k]) for k in measured if k in guess})


def _summed(scores: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    return {field: sum(s[field] for s in scores) for field in ("num_within_target", "num_figures")}


def replication(reports: Sequence[Path], runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`runs`: `validate`'s output for each report, in the same order. `sets`: per set, the model's and the
    other sets' scores against its median measurements (`set_totals`: summed); `runs`: summed over the runs,
    the model's and the rest of its set's scores against each run's measurements."""
    if len(reports) != len(runs):
        raise ValueError("one validation per report")
    sets: dict[str, list[Mapping[str, Any]]] = {}
    for report, run in zip(reports, runs):
        sets.setdefault(set_name(report), []).append(run)
    if len(sets) < 2:
        raise ValueError("--replication needs runs from at least two sets (directories holding run-*/); "
                         "give them with --report or --all-runs")
    per_set: dict[str, Any] = {}
    for name, own in sets.items():
        others = [run for other, group in sets.items() if other != name for run in group]
        measured = _medians(own, "measured")
        per_set[name] = {"repetitions": len(own), "other_repetitions": len(others),
                         "model": _scored(_medians(own, "predicted"), measured),
                         "other_sets": _scored(_medians(others, "measured"), measured)}
    per_run: dict[str, list[dict[str, Any]]] = {"model": [], "same_set_runs": []}
    for own in sets.values():
        for i, run in enumerate(own):
            rest = own[:i] + own[i + 1:]
            if rest:
                measured = _medians([run], "measured")
                per_run["model"].append(_scored(_medians([run], "predicted"), measured))
                per_run["same_set_runs"].append(_scored(_medians(rest, "measured"), measured))
    return {"sets": per_set,
            "set_totals": {side: _summed([s[side] for s in per_set.values()]) for side in ("model", "other_sets")},
            "runs": {side: _summed(scores) for side, scores in per_run.items()}}
