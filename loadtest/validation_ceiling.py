"""`pdserve-loadtest validate --noise-ceiling`: how often a model that is exactly right would meet the
validation's ±20% target against live runs like the committed ones.

A live run's router polls the replicas' stats from a timer that started at an arbitrary moment against the
run's arrivals, so which replica each request lands on, and each p90 with it, is a draw. The simulator
reproduces that draw (`RouterSpec.poll_phase`). Here the simulator, calibrated on each live run as the
validation calibrates it, stands in for the live system: a virtual repetition of a run takes every point at a
phase drawn at random (independently per point, as each live point is a fresh load run), and the virtual
measurement is the median over repetitions, as the validation combines live runs. Against the validation's
own prediction (the median over its evenly spaced phases) it gives the chance that every figure of a
scenario is within the target with that many repetitions.

The poll phase is one source of the live runs' spread, not all of it (the VM's step timing varies too), so
this is an upper bound on what an exact model can reach against such runs: where it is low, no model can be
expected to meet the target with that many repetitions.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.loadtest.goodput_ratio import crossing
from pdserve.loadtest.validate import TARGET_ERROR
from pdserve.loadtest.validation_model import LATENCIES, Model
from pdserve.sim.calibrate import Calibration, rel_error
from pdserve.sim.config import ClusterSpec

CEILING_PHASES = 32  # phases a live point is drawn from, evenly spaced over the poll period
DRAWS = 2000
REPETITIONS = (1, 3, 5, 9, 15)
SEED = 0


def point_figures(aggregate: dict[str, Any]) -> dict[str, float]:
    """One simulated point's latency figures (ms, named as the validation's) and its SLO attainment."""
    out = {name: aggregate[name.replace("_ms", "_s")] * 1e3 for name, _, _ in LATENCIES
           if aggregate.get(name.replace("_ms", "_s")) is not None}
    return {**out, "slo_attainment": float(aggregate["slo_attainment"])}


@dataclass
class RunPhases:
    """One live run's points simulated at each phase, its targets' rates, and the validation's predictions."""
    phases: int = CEILING_PHASES
    points: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # "target/rate" -> per phase
    rates: dict[str, list[float]] = field(default_factory=dict)  # target -> its rates, ascending
    predicted: dict[str, float] = field(default_factory=dict)  # figure -> the validation's prediction
    # the sweep measures its grid's rates only: the live rates are the simulated ones, so goodput compares
    fixed_grid: bool = True
    goal: float = 0.9  # the sweep's attainment target

    def __call__(self, model: Model, target: dict[str, Any], spec: ClusterSpec, cal: Calibration) -> None:
        """validate()'s `observe`: simulate the target's points at every phase, with its calibration."""
        rates = sorted(p["rate"] for p in target["points"])
        self.rates[target["name"]] = rates
        self.fixed_grid = model.sweep.max_runs <= len(model.sweep.rates)
        self.goal = model.sweep.target
        for rate in rates:
            runs = model.phase_points(spec, cal, rate, self.phases)
            self.points[f"{target['name']}/{rate:.3g}"] = [point_figures(agg) for agg, *_ in runs]

    def draw(self, rng: random.Random, goal: float) -> dict[str, float]:
        """One virtual repetition: every point at a phase drawn for it; each target's goodput where the
        drawn points' attainment crosses `goal`."""
        out: dict[str, float] = {}
        for target, rates in self.rates.items():
            attained = []
            for rate in rates:
                key = f"{target}/{rate:.3g}"
                figures = rng.choice(self.points[key])
                out.update({f"{key}/{name}": v for name, v in figures.items() if name != "slo_attainment"})
                attained.append((rate, figures["slo_attainment"]))
            out[f"{target}/goodput_rps"] = crossing(attained, goal).rps
        return out

    def spread(self, name: str) -> float:
        """Half the range over the median of a latency figure across the phases (0 for goodput)."""
        key, _, figure = name.rpartition("/")
        values = [p[figure] for p in self.points.get(key, [])]
        mid = statistics.median(values) if values else 0.0
        return (max(values) - min(values)) / 2 / mid if mid else 0.0


def ceiling(runs: Sequence[RunPhases], goal: float, draws: int = DRAWS,
            repetitions: Sequence[int] = REPETITIONS, seed: int = SEED) -> dict[str, Any]:
    """The chance that every figure is within the target, per number of repetitions (run i of them is the
    live run i mod len(runs), with its calibration and prediction); per figure at the live count."""
    rng = random.Random(seed)
    names = [n for n in runs[0].predicted if all(n in r.predicted for r in runs)]
    # a bisecting sweep tried other rates live than in the simulator: its goodput has no virtual twin here
    left_out = [] if all(r.fixed_grid for r in runs) else [n for n in names if n.endswith("/goodput_rps")]
    names = [n for n in names if n not in left_out]
    by_reps: dict[str, Any] = {}
    per_figure: dict[str, float] = {}
    for reps in sorted({*repetitions, len(runs)}):
        chosen = [runs[i % len(runs)] for i in range(reps)]
        predicted = {n: statistics.median(r.predicted[n] for r in chosen) for n in names}
        passed, worst = 0, []
        within = dict.fromkeys(names, 0)
        for _ in range(draws):
            virtual = [r.draw(rng, goal) for r in chosen]
            errors = {n: rel_error(predicted[n], statistics.median(v[n] for v in virtual)) for n in names}
            for n, e in errors.items():
                within[n] += e <= TARGET_ERROR
            worst.append(max(errors.values(), default=0.0))
            passed += worst[-1] <= TARGET_ERROR
        worst.sort()
        by_reps[str(reps)] = {"p_all_within_target": passed / draws,
                              "max_abs_rel_error_p50": worst[len(worst) // 2],
                              "max_abs_rel_error_p90": worst[int(0.9 * (len(worst) - 1))]}
        if reps == len(runs):
            per_figure = {n: within[n] / draws for n in names}
    spreads = {n: max(r.spread(n) for r in runs) for n in names}
    return {
        "phases": runs[0].phases, "draws": draws, "seed": seed, "live_repetitions": len(runs), "left_out": left_out,
        "by_repetitions": by_reps,
        "num_figures_phase_spread_over_target": sum(s > TARGET_ERROR for s in spreads.values()),
        "max_phase_spread": max(spreads.values(), default=0.0),
        "figures_below_0.95": dict(sorted(((n, p) for n, p in per_figure.items() if p < 0.95), key=lambda kv: kv[1])),
    }
