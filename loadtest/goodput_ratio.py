"""One target's goodput over another's, across repeated live runs of a scenario, with its interval.

A report's goodput is the highest rate of its grid with SLO attainment at the target (DistServe's
definition), so two targets on a grid of rates a factor 2 apart can only differ by 1x, 2x or a bound. Here
each target's goodput is also read where its attainment curve crosses the target: linearly between the
highest passing rate and the next rate tried. That is `at_least` the top rate when every rate passed, and
`below` the lowest when none did; a ratio of bounds is a bound (`at_least`, `at_most`) or `unknown`.

Per run: each target's crossing and the ratio. Pooled: the runs' points at each rate merged (attainment
weighted by requests), one crossing per target, and a 90% interval from resampling every point's
requests (binomially, at its pooled attainment; the runs' spread is beside it, not inside it), whose
ends are None where the draws leave them unbounded.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

@dataclass(frozen=True)
class Goodput:
    rps: float
    bound: str  # "exact", "at_least" (every rate passed) or "below" (none did)


def crossing(points: Sequence[tuple[float, float]], target: float) -> Goodput:
    """Where attainment crosses `target`; `points`: (rate, attainment)."""
    if not points:
        raise ValueError("no points to read a goodput from")
    points = sorted(points)
    passing = [i for i, (_, a) in enumerate(points) if a >= target]
    if not passing:
        return Goodput(points[0][0], "below")
    i = passing[-1]
    if i == len(points) - 1:
        return Goodput(points[i][0], "at_least")
    (r0, a0), (r1, a1) = points[i], points[i + 1]
    return Goodput(r0 + (r1 - r0) * (a0 - target) / (a0 - a1), "exact")


def crossing_figure(predicted: Mapping[float, float], measured: Sequence[Mapping[str, Any]], goal: float
                    ) -> dict[str, Any]:
    """A validation figure: the goodput at the crossing, from the simulator's rate -> attainment against a
    report target's points, each with its bound."""
    p = crossing(list(predicted.items()), goal)
    m = crossing([(pt["rate"], pt["attainment"]) for pt in measured], goal)
    return {"predicted": p.rps, "measured": m.rps, "predicted_bound": p.bound, "measured_bound": m.bound}


def ratio(a: Goodput, b: Goodput) -> tuple[float | None, str]:
    """(a / b, its bound): exact, at_least, at_most or unknown (None when nothing can be said)."""
    if b.rps <= 0:
        return None, "unknown"
    value = a.rps / b.rps
    up = {"at_least": "at_least", "below": "at_most"}  # what a's bound makes of the ratio
    down = {"at_least": "at_most", "below": "at_least"}  # what b's bound makes of it
    moves = {m for m in (up[a.bound] if a.bound != "exact" else None,
                         down[b.bound] if b.bound != "exact" else None) if m}
    if not moves:
        return value, "exact"
    return (value, moves.pop()) if len(moves) == 1 else (None, "unknown")


def _points(target: Mapping[str, Any]) -> list[tuple[float, float, int]]:
    return [(p["rate"], p["attainment"], p["summary"]["counts"]["total"]) for p in target["points"]]


def pooled(runs: Sequence[Mapping[str, Any]], name: str) -> list[tuple[float, float, int]]:
    """(rate, attainment, requests) at each rate, over every run's points of target `name`."""
    by_rate: dict[float, list[tuple[float, int]]] = {}
    for run in runs:
        for rate, attainment, n in _points(_target(run, name)):
            by_rate.setdefault(round(rate, 6), []).append((attainment, n))
    return [(rate, sum(a * n for a, n in pts) / sum(n for _, n in pts), sum(n for _, n in pts))
            for rate, pts in sorted(by_rate.items())]


def _target(run: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    for target in run["targets"]:
        if target["name"] == name:
            return target
    raise ValueError(f"report {run.get('scenario')!r} has no target {name!r}")


def bootstrap(points: Sequence[tuple[float, float, int]], base: Sequence[tuple[float, float, int]], goal: float,
              samples: int = 2000, seed: int = 0) -> list[float | None]:
    """A 90% interval of the pooled ratio: each point's requests drawn again at its attainment. A draw whose
    ratio is a bound gives only that end (at_least: a floor, at_most: a ceiling, unknown: neither), so the
    interval is the 5th percentile of the floors and the 95th of the ceilings; None: unbounded."""
    rng = random.Random(seed)

    def draw(pts: Sequence[tuple[float, float, int]]) -> list[tuple[float, float]]:
        return [(r, sum(rng.random() < a for _ in range(n)) / n) for r, a, n in pts]

    floors, ceilings = [], []
    for _ in range(samples):
        value, bound = ratio(crossing(draw(points), goal), crossing(draw(base), goal))
        floors.append(value if bound in ("exact", "at_least") else 0.0)
        ceilings.append(value if bound in ("exact", "at_most") else math.inf)
    low, high = statistics.quantiles(floors, n=20)[0], statistics.quantiles(ceilings, n=20)[-1]
    return [low if low > 0 else None, high if math.isfinite(high) else None]


def goodput_ratios(runs: Sequence[Mapping[str, Any]], target: str | None = None,
                   baselines: Sequence[str] | None = None) -> dict[str, Any]:
    """`target` (default: the reports' SLO reference) over each baseline (default: every other target)."""
    if not runs:
        raise ValueError("no reports")
    goal = float(runs[0]["attainment_target"])
    names = [t["name"] for t in runs[0]["targets"]]
    target = target or runs[0].get("slo_reference") or names[0]
    baselines = list(baselines or [n for n in names if n != target])
    top = pooled(runs, target)
    out: dict[str, Any] = {}
    for base in baselines:
        per_run = []
        for run in runs:
            a = crossing([(r, at) for r, at, _ in _points(_target(run, target))], goal)
            b = crossing([(r, at) for r, at, _ in _points(_target(run, base))], goal)
            value, bound = ratio(a, b)
            per_run.append({"ratio": value, "bound": bound, "goodput": {target: vars(a), base: vars(b)},
                            "grid_goodput": {target: _target(run, target)["goodput"], base: _target(run, base)["goodput"]}})
        low = pooled(runs, base)
        a, b = crossing([(r, at) for r, at, _ in top], goal), crossing([(r, at) for r, at, _ in low], goal)
        value, bound = ratio(a, b)
        exact = [r["ratio"] for r in per_run if r["bound"] == "exact"]
        out[f"{target}/{base}"] = {
            "pooled": {"ratio": value, "bound": bound, "goodput": {target: vars(a), base: vars(b)},
                       "interval_90": bootstrap(top, low, goal),
                       "points": {target: top, base: low}},
            "runs": per_run, "runs_range": [min(exact), max(exact)] if exact else None,
            "runs_exact": len(exact), "repetitions": len(runs)}
    return out


def ratio_main(results: Path, target: str | None, baselines: Sequence[str] | None) -> dict[str, Any]:
    """The reports of `results` (run-*/summary.json, else summary.json)."""
    from pdserve.loadtest.validation_runs import load_reports

    reports = load_reports(results)
    try:
        return {"reports": [str(p) for p, _ in reports],
                "ratios": goodput_ratios([r for _, r in reports], target, baselines)}
    except KeyError as exc:
        raise ValueError(f"{results}: a report lacks {exc}") from None
