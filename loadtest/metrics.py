"""Per-request latency metrics and a run's summary, defined as `vllm bench serve` defines them.

TTFT: send -> first token chunk. E2E: send -> end of stream. ITL: every gap between consecutive
token chunks. TPOT: (E2E - TTFT) / (output tokens - 1), undefined for a single output token.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from pdserve.loadtest.client import RequestResult

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class RequestMetrics:
    ttft_s: float
    tpot_s: float | None
    itl_s: tuple[float, ...]
    e2e_s: float
    output_tokens: int


def request_metrics(result: RequestResult) -> RequestMetrics | None:
    """None unless the request completed."""
    if not result.ok or not result.chunk_times or result.e2e_s is None:
        return None
    ttft = result.chunk_times[0]
    tpot = (result.e2e_s - ttft) / (result.output_tokens - 1) if result.output_tokens > 1 else None
    itl = tuple(b - a for a, b in itertools.pairwise(result.chunk_times))
    return RequestMetrics(ttft, tpot, itl, result.e2e_s, result.output_tokens)


def percentile(values: list[float] | tuple[float, ...], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default, as vllm bench); None when empty."""
    return float(np.percentile(np.asarray(values, dtype=float), p)) if len(values) else None


def stats(values: list[float] | tuple[float, ...]) -> dict[str, float | None]:
    out: dict[str, float | None] = {"mean": float(np.mean(values)) if len(values) else None}
    out.update({f"p{p}": percentile(values, p) for p in PERCENTILES})
    return out


@dataclass(frozen=True)
class Counts:
    total: int
    completed: int
    rejected: int
    errors: int
    cancelled: int

    @property
    def failed(self) -> int:
        return self.rejected + self.errors + self.cancelled


def counts(results: list[RequestResult]) -> Counts:
    by = {s: sum(r.status == s for r in results) for s in ("ok", "rejected", "error", "cancelled")}
    return Counts(len(results), by["ok"], by["rejected"], by["error"], by["cancelled"])


@dataclass(frozen=True)
class RunSummary:
    rate: float | None  # offered rate (req/s); None for a closed loop
    concurrency: int | None
    duration_s: float
    counts: Counts
    request_throughput: float  # completed requests / duration
    output_throughput: float  # output tokens of completed requests / duration
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    # cached prompt tokens (usage.prompt_tokens_details) / prompt tokens, over the completed requests
    prefix_hit_rate: float | None = None
    # mean requests between their first token and their end over the run, all replicas together: the
    # app's decode batch (what `pdserve-loadtest bound` prices a request's decode at, over the replicas)
    decoding_concurrency: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    results: list[RequestResult], duration_s: float, rate: float | None = None, concurrency: int | None = None
) -> RunSummary:
    done = [m for m in map(request_metrics, results) if m is not None]

    def ms(values: list[float]) -> dict[str, float | None]:
        return {k: (v * 1e3 if v is not None else None) for k, v in stats(values).items()}

    duration = max(duration_s, 1e-9)
    return RunSummary(
        rate=rate, concurrency=concurrency, duration_s=duration_s, counts=counts(results),
        request_throughput=len(done) / duration,
        output_throughput=sum(m.output_tokens for m in done) / duration,
        ttft_ms=ms([m.ttft_s for m in done]),
        tpot_ms=ms([m.tpot_s for m in done if m.tpot_s is not None]),
        itl_ms=ms([g for m in done for g in m.itl_s]),
        e2e_ms=ms([m.e2e_s for m in done]),
        prefix_hit_rate=prefix_hit_rate(results),
        decoding_concurrency=sum(m.e2e_s - m.ttft_s for m in done) / duration if done else None,
    )


def prefix_hit_rate(results: list[RequestResult]) -> float | None:
    """Cached prompt tokens / prompt tokens over the completed requests; None when none completed."""
    done = [r for r in results if r.ok]
    prompt = sum(r.prompt_len for r in done)
    return sum(r.cached_tokens for r in done) / prompt if prompt else None
