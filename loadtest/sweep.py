"""DistServe goodput: the highest rate whose SLO attainment is >= the target, found by a rate sweep.

Attainment is assumed non-increasing in the rate. The whole grid of rates is measured first (the
same rates for every target: the curves in the plots), then the bracket between the first failing
grid rate and the highest passing one below it is bisected (geometrically) until it is within
`rel_tol` or `max_runs` runs have been spent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.loadtest.slo import ATTAINMENT_TARGET


@dataclass(frozen=True)
class SweepConfig:
    rates: tuple[float, ...] = (0.5, 1.0, 2.0)  # grid, always measured (ascending)
    max_runs: int = 6  # grid included
    rel_tol: float = 0.1  # stop when (hi - lo) / lo <= rel_tol
    target: float = ATTAINMENT_TARGET

    def __post_init__(self) -> None:
        if not self.rates or any(r <= 0 for r in self.rates) or list(self.rates) != sorted(set(self.rates)):
            raise ValueError("rates must be positive, distinct and ascending")
        if self.max_runs < len(self.rates):
            raise ValueError("max_runs must cover the grid")


@dataclass
class SweepResult:
    points: dict[float, float] = field(default_factory=dict)  # rate -> attainment, in measurement order
    goodput: float = 0.0  # 0: even the lowest rate tried (down to grid[0] / 2^k) missed the target
    bracket: tuple[float, float | None] = (0.0, None)  # (highest passing, lowest failing) rate

    @property
    def capped(self) -> bool:
        """True when every measured rate passed: the goodput is at least the highest rate tried."""
        return self.bracket[1] is None and bool(self.points)


def find_goodput(measure: Callable[[float], float], config: SweepConfig) -> SweepResult:
    """`measure(rate)` runs the load at `rate` and returns its SLO attainment."""
    result = SweepResult()

    def run(rate: float) -> bool:
        result.points[rate] = measure(rate)
        return result.points[rate] >= config.target

    passed = [run(rate) for rate in config.rates]
    first_fail = next((i for i, ok in enumerate(passed) if not ok), None)
    hi = config.rates[first_fail] if first_fail is not None else None
    lo = max((r for r, ok in zip(config.rates, passed) if ok and (hi is None or r < hi)), default=0.0)
    while hi is not None and len(result.points) < config.max_runs and (lo == 0 or (hi - lo) / lo > config.rel_tol):
        mid = hi / 2 if lo == 0 else math.sqrt(lo * hi)  # below the grid: halve until a rate passes
        if run(mid):
            lo = mid
        else:
            hi = mid
    result.goodput, result.bracket = lo, (lo, hi)
    return result
