"""`pdserve-loadtest validate --speed-sensitivity`: how precisely each figure needs the replicas' speed, against
how much this host's speed moves between measurements minutes apart.

The validation times every point with the speed measured before the run (the machine check) and re-timed by the
engines' step counters at each target's lowest rate (pdserve.loadtest.validation_model). Near saturation a
latency moves by several per cent for each per cent of speed, so the ±20% target leaves the speed a narrow margin
there: a figure with elasticity E stays within the target only while the modelled speed is within
1.2^(1/|E|) − 1 of the live one. A run's machine checks (each target measures the same shapes on the same model
before it deploys, a few minutes after the one before) say how much the host's speed moves between measurements
minutes apart, as a target's loaded points follow its lowest rate: where that spread exceeds a figure's margin,
a calibration made minutes before the figure's point cannot be expected to meet the target for it, however
right the model. The spread is taken within each run (runs of other days or commits differ by more) and its
median over the runs is the host's.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.loadtest.machine import SPEED_SHAPES
from pdserve.loadtest.validate import TARGET_ERROR
from pdserve.loadtest.validation_model import Model, compare
from pdserve.sim.calibrate import Calibration
from pdserve.sim.config import ClusterSpec

SPEED_STEP = 0.05  # each speed scale times 1 ± this, for the elasticity


def slower(cal: Calibration, factor: float) -> Calibration:
    """Every replica step `factor` times as long (the prefill, its cached term and both decode terms)."""
    cached = None if cal.prefill_cached_scale is None else cal.prefill_cached_scale * factor
    return dataclasses.replace(cal, prefill_scale=cal.prefill_scale * factor, prefill_cached_scale=cached,
                               decode_fixed_scale=cal.decode_fixed_scale * factor,
                               decode_row_scale=cal.decode_row_scale * factor)


def margin(elasticity: float, target: float = TARGET_ERROR) -> float:
    """The relative speed error that moves a figure of this elasticity by `target`."""
    return math.inf if abs(elasticity) < 1e-9 else (1.0 + target) ** (1.0 / abs(elasticity)) - 1.0


def spread(values: Sequence[float]) -> float:
    """Half the range over the median."""
    mid = statistics.median(values)
    return (max(values) - min(values)) / 2 / mid if mid else 0.0


@dataclass
class RunSpeeds:
    """One live run: per figure its elasticity to the replicas' speed; per target, in order, its machine check's
    speed shapes (ms)."""
    step: float = SPEED_STEP
    elasticity: dict[str, float] = field(default_factory=dict)
    shapes: list[dict[str, float]] = field(default_factory=list)

    def __call__(self, model: Model, target: dict[str, Any], spec: ClusterSpec, cal: Calibration) -> None:
        """validate()'s `observe`, with the target's calibration."""
        span = math.log((1 + self.step) / (1 - self.step))
        for point in target["points"]:
            rate, key = point["rate"], f"{target['name']}/{point['rate']:.3g}"
            up = compare(model.point(spec, slower(cal, 1 + self.step), rate), point["summary"])
            down = compare(model.point(spec, slower(cal, 1 - self.step), rate), point["summary"])
            for name in up.keys() & down.keys():
                low, high = down[name]["predicted"], up[name]["predicted"]
                if low > 0 and high > 0:
                    self.elasticity[f"{key}/{name}"] = math.log(high / low) / span
        for check in (target.get("machine") or model.report.get("machine") or [])[:1]:
            self.shapes.append({s["shape"]: float(s["measured_ms"]) for s in check["shapes"]
                                if s["shape"] in SPEED_SHAPES})


def within_runs(runs: Sequence[RunSpeeds]) -> dict[str, float]:
    """Per speed shape: the median over the runs with two checks or more of its spread across a run's checks."""
    out = {}
    for name in sorted(SPEED_SHAPES):
        spreads = [spread(values) for r in runs if len(values := [c[name] for c in r.shapes if name in c]) > 1]
        if spreads:
            out[name] = statistics.median(spreads)
    return out


def sensitivity(runs: Sequence[RunSpeeds]) -> dict[str, Any]:
    """Per figure the median elasticity over the runs and its speed margin; per speed shape the machine checks'
    spread within a run (`within_runs`), and their median as the host's; the figures whose margin is below it."""
    checks = [c for r in runs for c in r.shapes]
    shapes = within_runs(runs)
    host = statistics.median(shapes.values()) if shapes else None
    figures: dict[str, Any] = {}
    for name in sorted({n for r in runs for n in r.elasticity}):
        e = statistics.median(r.elasticity[name] for r in runs if name in r.elasticity)
        figures[name] = {"elasticity": e, "speed_margin": margin(e)}
        if host is not None:
            figures[name]["margin_below_host_spread"] = margin(e) < host
    return {"speed_step": runs[0].step if runs else SPEED_STEP, "machine_checks": len(checks),
            "machine_check_spread": shapes, "host_speed_spread": host, "figures": figures,
            "num_margin_below_host_spread": sum(bool(f.get("margin_below_host_spread")) for f in figures.values())}
