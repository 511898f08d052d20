"""Router-only series (requests by endpoint and status, requests in flight), kept in the registry of the
router's ServingMetrics so one /metrics exposition carries everything."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class APIMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("pdserve_router_requests", "Requests by endpoint and status", ["endpoint", "status"],
                                registry=registry)
        self.inflight = Gauge("pdserve_router_inflight_requests", "Requests in flight", registry=registry)
        # coalescing shows as writes < events: one write carries every event that arrived meanwhile
        self.stream_writes = Counter("pdserve_router_stream_writes", "SSE writes (one per coalesced batch)",
                                     registry=registry)
        self.stream_events = Counter("pdserve_router_stream_events", "SSE events with a choice written",
                                     registry=registry)
        self.worker_calls = Counter("pdserve_router_worker_calls", "Prefill and decode calls by role and path "
                                    "(link: pdserve.worklink; serve: a Serve handle)", ["role", "path"],
                                    registry=registry)
        self.stats_polls = Counter("pdserve_router_stats_polls", "Replica stats polls answered, by role and path "
                                   "(link: a STATS call on the worker link; serve: the replica actor)",
                                   ["role", "path"], registry=registry)
        self.migrations = Counter("pdserve_migrations", "Streams moved to another decode replica mid-stream",
                                  ["reason"], registry=registry)

    def count_migration(self, reason: str) -> None:
        self.migrations.labels(reason).inc()

    def count_worker_call(self, role: str, path: str) -> None:
        self.worker_calls.labels(role, path).inc()

    def count_stats_poll(self, role: str, path: str) -> None:
        self.stats_polls.labels(role, path).inc()

    def count_write(self, num_events: int) -> None:
        self.stream_writes.inc()
        self.stream_events.inc(num_events)
