"""Token-length distributions for synthetic prompts and outputs: fixed, uniform, lognormal."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np


class LengthDist(ABC):
    @abstractmethod
    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """n lengths, each >= 1."""

    @property
    @abstractmethod
    def mean(self) -> float: ...


@dataclass(frozen=True)
class Fixed(LengthDist):
    value: int

    def __post_init__(self) -> None:
        if self.value < 1:
            raise ValueError("a fixed length must be >= 1")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [self.value] * n

    @property
    def mean(self) -> float:
        return float(self.value)


@dataclass(frozen=True)
class Uniform(LengthDist):
    low: int
    high: int  # inclusive

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError("uniform lengths need 1 <= low <= high")

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2


@dataclass(frozen=True)
class LogNormal(LengthDist):
    """Parameterised by the mean and std of the lengths themselves, not of their logarithm; then clipped."""

    mean_len: float
    std_len: float
    min_len: int = 1
    max_len: int = 1 << 20

    def __post_init__(self) -> None:
        if self.mean_len <= 0 or self.std_len < 0 or not 1 <= self.min_len <= self.max_len:
            raise ValueError("lognormal lengths need mean > 0, std >= 0 and 1 <= min <= max")

    @property
    def sigma(self) -> float:
        return math.sqrt(math.log1p((self.std_len / self.mean_len) ** 2))

    @property
    def mu(self) -> float:
        return math.log(self.mean_len) - self.sigma**2 / 2

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        raw = rng.lognormal(self.mu, self.sigma, size=n)
        return [int(x) for x in np.clip(np.rint(raw), self.min_len, self.max_len)]

    @property
    def mean(self) -> float:
        return float(self.mean_len)  # before clipping


DISTRIBUTIONS: dict[str, type[LengthDist]] = {"fixed": Fixed, "uniform": Uniform, "lognormal": LogNormal}


def length_dist(spec: int | dict[str, Any] | LengthDist) -> LengthDist:
    """`128`, `{dist: fixed, value: 128}`, `{dist: uniform, low: 1, high: 9}` or
    `{dist: lognormal, mean: 1500, std: 500, min: 64, max: 3500}`."""
    if isinstance(spec, LengthDist):
        return spec
    if isinstance(spec, int):
        return Fixed(spec)
    spec = dict(spec)
    kind = spec.pop("dist", "fixed")
    if kind not in DISTRIBUTIONS:
        raise ValueError(f"unknown length distribution {kind!r}; known: {sorted(DISTRIBUTIONS)}")
    if kind == "lognormal":
        renames = {"mean": "mean_len", "std": "std_len", "min": "min_len", "max": "max_len"}
        spec = {renames.get(k, k): v for k, v in spec.items()}
    return DISTRIBUTIONS[kind](**spec)
