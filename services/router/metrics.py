"""Router metrics in a registry of their own (one per replica), exposed on /metrics."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("pdserve_router_requests", "Requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.decisions = Counter("pdserve_router_decisions", "Disaggregate/skip decisions", ["decision", "reason"], registry=r)
        self.fallbacks = Counter("pdserve_router_fallbacks", "Decode fallbacks to local prefill", ["reason"], registry=r)
        self.rejections = Counter("pdserve_router_rejections", "Requests rejected before any engine", ["reason"], registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("pdserve_router_generation_tokens", "Tokens generated", registry=r)
        self.inflight = Gauge("pdserve_router_inflight_requests", "Requests in flight", registry=r)
        self.ttft = Histogram("pdserve_router_ttft_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_router_e2e_seconds", "Request latency, end to end", buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


__all__ = ["CONTENT_TYPE", "RouterMetrics"]
