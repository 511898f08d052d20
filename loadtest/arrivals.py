"""Open-loop arrival processes: when each request is sent, as offsets in seconds from the run start.

Interarrival gaps follow `vllm bench serve`: gamma with shape = burstiness and scale =
1 / (rate * burstiness), so the mean rate is `rate` for any burstiness and the coefficient of
variation of the gaps is 1 / sqrt(burstiness). Burstiness 1 is Poisson; < 1 is burstier.
The first request goes out at offset 0.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np


class ArrivalProcess(ABC):
    @abstractmethod
    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """n - 1 interarrival gaps (seconds)."""

    def schedule(self, n: int, seed: int) -> list[float]:
        if n <= 0:
            return []
        gaps = self.gaps(n, np.random.default_rng(seed))
        return [0.0, *np.cumsum(gaps).tolist()]


@dataclass(frozen=True)
class Gamma(ArrivalProcess):
    rate: float  # requests per second; inf sends everything at once
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burstiness <= 0:
            raise ValueError("rate and burstiness must be positive")

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if math.isinf(self.rate):
            return np.zeros(n - 1)
        return rng.gamma(shape=self.burstiness, scale=1.0 / (self.rate * self.burstiness), size=n - 1)


@dataclass(frozen=True)
class Poisson(Gamma):
    def __post_init__(self) -> None:
        if self.burstiness != 1.0:
            raise ValueError("a Poisson process has burstiness 1; use gamma")
        super().__post_init__()


@dataclass(frozen=True)
class Constant(ArrivalProcess):
    rate: float

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError("rate must be positive")

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.full(n - 1, 0.0 if math.isinf(self.rate) else 1.0 / self.rate)


@dataclass(frozen=True)
class Trace(ArrivalProcess):
    """Recorded offsets (e.g. Mooncake timestamps), replayed as is or time-scaled to a mean rate."""

    offsets: tuple[float, ...]
    rate: float | None = None

    @property
    def native_rate(self) -> float:
        span = self.offsets[-1] - self.offsets[0] if len(self.offsets) > 1 else 0.0
        return (len(self.offsets) - 1) / span if span > 0 else math.inf

    def gaps(self, n: int, rng: np.random.Generator) -> np.ndarray:
        if n > len(self.offsets):
            raise ValueError(f"the trace has {len(self.offsets)} arrivals, {n} were asked for")
        gaps = np.diff(np.asarray(self.offsets[:n], dtype=float))
        if self.rate is None or math.isinf(self.native_rate):
            return gaps
        return gaps * (self.native_rate / self.rate)


ARRIVALS: dict[str, type[ArrivalProcess]] = {"poisson": Poisson, "gamma": Gamma, "constant": Constant}


def arrival_process(kind: str, rate: float, **options: Any) -> ArrivalProcess:
    if kind not in ARRIVALS:
        raise ValueError(f"unknown arrival process {kind!r}; known: {sorted(ARRIVALS)}")
    return ARRIVALS[kind](rate=rate, **options)
