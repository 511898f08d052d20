"""SLOs, SLO attainment and goodput (DistServe's definitions).

Attainment: the share of all issued requests that completed with TTFT <= ttft and TPOT <= tpot.
Rejected, failed and cancelled requests are misses. A request with one output token has no TPOT
and is judged on TTFT alone. Request goodput at one rate: good requests / run duration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.loadtest.client import RequestResult
from pdserve.loadtest.metrics import request_metrics

ATTAINMENT_TARGET = 0.9


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError("SLO bounds must be positive")

    def met(self, result: RequestResult) -> bool:
        m = request_metrics(result)
        return m is not None and m.ttft_s <= self.ttft_s and (m.tpot_s is None or m.tpot_s <= self.tpot_s)

    def to_dict(self) -> dict[str, float]:
        return {"ttft_ms": self.ttft_s * 1e3, "tpot_ms": self.tpot_s * 1e3}


@dataclass(frozen=True)
class IdleLatency:
    """Median TTFT and TPOT of a few sequential requests on an otherwise idle target."""

    ttft_s: float
    tpot_s: float

    def to_dict(self) -> dict[str, float]:
        return {"ttft_ms": self.ttft_s * 1e3, "tpot_ms": self.tpot_s * 1e3}


@dataclass(frozen=True)
class SLOSpec:
    """Absolute bounds (`ttft_ms`, `tpot_ms`) or factors of a reference target's idle latency."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    ttft_factor: float | None = None
    tpot_factor: float | None = None

    def __post_init__(self) -> None:
        for absolute, factor, name in ((self.ttft_ms, self.ttft_factor, "ttft"), (self.tpot_ms, self.tpot_factor, "tpot")):
            if (absolute is None) == (factor is None):
                raise ValueError(f"give exactly one of {name}_ms and {name}_factor")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SLOSpec:
        return cls(**data)

    @property
    def needs_reference(self) -> bool:
        return self.ttft_factor is not None or self.tpot_factor is not None

    def resolve(self, idle: IdleLatency | None) -> SLO:
        if self.needs_reference and idle is None:
            raise ValueError("a relative SLO needs the reference target's idle latency")
        ttft = self.ttft_ms / 1e3 if self.ttft_ms is not None else self.ttft_factor * idle.ttft_s
        tpot = self.tpot_ms / 1e3 if self.tpot_ms is not None else self.tpot_factor * idle.tpot_s
        return SLO(ttft, tpot)


def attainment(results: list[RequestResult], slo: SLO) -> float:
    return sum(slo.met(r) for r in results) / len(results) if results else 0.0


def request_goodput(results: list[RequestResult], slo: SLO, duration_s: float) -> float:
    return sum(slo.met(r) for r in results) / duration_s if duration_s > 0 else 0.0
