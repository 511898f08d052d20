"""Router-only series (requests by endpoint and status, requests in flight), kept in the registry of the
router's ServingMetrics so one /metrics exposition carries everything."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


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

    def watch_replicas(self, registry: CollectorRegistry, live: Callable[[str], int], roles: tuple[str, ...]) -> None:
        """`pdserve_router_live_replicas{role}` at every scrape: replicas the stats poller sees alive,
        0 for a role that has none (an alert can fire on it; an absent series could not)."""
        registry.register(LiveReplicasCollector(live, roles))

    def watch_queue(self, registry: CollectorRegistry, queue) -> None:
        """`pdserve_router_queued_requests` and `pdserve_router_queue_outcomes_total{outcome}` from the
        router's PlacementQueue at every scrape."""
        registry.register(QueueCollector(queue))

    def watch_sync(self, registry: CollectorRegistry, sync) -> None:
        """`pdserve_router_placement_sync_messages_total{direction}` (sent, received, dropped) from the
        router's PlacementSync at every scrape."""
        registry.register(SyncCollector(sync))

    def count_migration(self, reason: str) -> None:
        self.migrations.labels(reason).inc()

    def count_worker_call(self, role: str, path: str) -> None:
        self.worker_calls.labels(role, path).inc()

    def count_stats_poll(self, role: str, path: str) -> None:
        self.stats_polls.labels(role, path).inc()

    def count_write(self, num_events: int) -> None:
        self.stream_writes.inc()
        self.stream_events.inc(num_events)


class LiveReplicasCollector:
    def __init__(self, live: Callable[[str], int], roles: tuple[str, ...]) -> None:
        self._live, self._roles = live, roles

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("pdserve_router_live_replicas",
                                   "Replicas per role that the router's stats poller sees alive", labels=["role"])
        for role in self._roles:
            family.add_metric([role], self._live(role))
        yield family

    def describe(self) -> list:
        return []


class QueueCollector:
    def __init__(self, queue) -> None:
        self._queue = queue

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        q = self._queue
        yield GaugeMetricFamily("pdserve_router_queued_requests",
                                "Requests waiting in the router's queue for a replica within their SLOs", value=len(q))
        outcomes = CounterMetricFamily("pdserve_router_queue_outcomes",
                                       "Requests that entered the router's queue (queued), or were refused by "
                                       "it (full, timed_out)", labels=["outcome"])
        for outcome, n in (("queued", q.num_queued), ("full", q.num_full), ("timed_out", q.num_timed_out)):
            outcomes.add_metric([outcome], n)
        yield outcomes

    def describe(self) -> list:
        return []


class SyncCollector:
    def __init__(self, sync) -> None:
        self._sync = sync

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("pdserve_router_placement_sync_messages",
                                     f"Placement sync messages ({self._sync.name}): sent to the other routers, "
                                     "received from them, dropped (publish failed or malformed)", labels=["direction"])
        for direction, n in (("sent", self._sync.num_sent), ("received", self._sync.num_received),
                             ("dropped", self._sync.num_dropped)):
            family.add_metric([direction], n)
        yield family

    def describe(self) -> list:
        return []
