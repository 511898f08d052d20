"""Simulated requests as the load tests' RequestResults, and their aggregates by the load tests' own
functions (pdserve.loadtest.metrics / slo): TTFT and TPOT percentiles, SLO attainment, goodput."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.loadtest.client import RequestResult
from pdserve.loadtest.metrics import percentile, summarize
from pdserve.loadtest.slo import SLO, attainment, request_goodput
from pdserve.sim.config import SimRequest


@dataclass
class RequestRecord:
    request: SimRequest
    status: str = "pending"  # "ok" | "rejected"
    first_token_s: float | None = None
    finish_s: float | None = None
    prefill_replica: str | None = None
    decode_replica: str | None = None
    num_preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (usage.prompt_tokens_details.cached_tokens)
    prefill_chunks: int = 0  # engine steps that computed part of the prompt

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.request.arrival_s

    @property
    def tpot_s(self) -> float | None:
        n = self.request.output_tokens
        if self.finish_s is None or self.first_token_s is None or n < 2:
            return None
        return (self.finish_s - self.first_token_s) / (n - 1)


def request_result(record: RequestRecord, max_duration_s: float | None = None) -> RequestResult:
    """A request unfinished at `max_duration_s` after the first arrival is cancelled, as the runner does."""
    req = record.request
    result = RequestResult(req.index, req.prompt_tokens, req.output_tokens, req.arrival_s, req.arrival_s)
    if record.status == "rejected":
        result.status, result.http_status = "rejected", 429
        return result
    if record.finish_s is None or (max_duration_s is not None and record.finish_s > max_duration_s):
        return result
    result.status, result.http_status = "ok", 200
    result.chunk_times = [record.first_token_s - req.arrival_s]  # type: ignore[operator]
    result.e2e_s = record.finish_s - req.arrival_s
    result.output_tokens = req.output_tokens
    return result


def duration_s(records: Sequence[RequestRecord], max_duration_s: float | None = None) -> float:
    """First arrival to the last finish (the runner's duration), capped at `max_duration_s`."""
    if not records:
        return 0.0
    start = min(r.request.arrival_s for r in records)
    end = max((r.finish_s for r in records if r.finish_s is not None), default=start)
    end = max(end, max(r.request.arrival_s for r in records))
    return min(end - start, max_duration_s) if max_duration_s is not None else end - start


def per_request(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    return [{"index": r.request.index, "arrival_s": r.request.arrival_s, "prompt_tokens": r.request.prompt_tokens,
             "output_tokens": r.request.output_tokens, "status": r.status, "first_token_s": r.first_token_s,
             "finish_s": r.finish_s, "ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "preemptions": r.num_preemptions,
             "cached_tokens": r.cached_tokens, "prefill_chunks": r.prefill_chunks,
             "prefill_replica": r.prefill_replica, "decode_replica": r.decode_replica} for r in records]


def aggregate(records: Sequence[RequestRecord], slo: SLO, rate: float | None = None,
              max_duration_s: float | None = None) -> dict[str, Any]:
    results = [request_result(r, max_duration_s) for r in records]
    duration = duration_s(records, max_duration_s)
    summary = summarize(results, duration, rate)
    ttfts = [r.chunk_times[0] for r in results if r.ok]
    tpots = [(r.e2e_s - r.chunk_times[0]) / (r.output_tokens - 1) for r in results if r.ok and r.output_tokens > 1]
    return {
        "rate": rate, "num_requests": len(results), "completed": summary.counts.completed,
        "rejected": summary.counts.rejected, "cancelled": summary.counts.cancelled, "duration_s": duration,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        "tpot_p50_s": percentile(tpots, 50), "tpot_p90_s": percentile(tpots, 90),
        "slo_attainment": attainment(results, slo), "goodput_rps": request_goodput(results, slo, duration),
        "preemptions": sum(r.num_preemptions for r in records),
    }


def median_aggregate(points: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per key, the median of several simulations of one point (numbers; None where every one is None);
    other values from the first."""
    out = dict(points[0])
    for key, value in out.items():
        if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
            values = [p[key] for p in points if p[key] is not None]
            out[key] = statistics.median(values) if values else None
    return out
