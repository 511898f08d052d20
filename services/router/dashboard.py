"""GET /dashboard (one self-contained page) and GET /dashboard/data (its JSON): the router's live SLA view,
from state the router keeps.

A poll costs the router one snapshot of its own registry and the tiles' arithmetic
(pdserve.observability.dashboard); it never waits on a worker. Worker series (queue depth, KV usage,
decode's handoff fallbacks) come from the snapshots /metrics caches, limited to replicas the stats poller
sees alive; when the newest is older than `dashboard_worker_refresh_s`, a poll starts one refresh in the
background and answers from the cache. Readings of the windowed series are kept at most one per
REFRESH_S for `slo_window_s`, so latency percentiles and rates cover the traffic of the last window
while someone watches (a shorter span right after the first poll, none at it); nothing is kept or
computed while nobody polls.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from pdserve.observability import dashboard as tiles
from pdserve.observability.metrics_snapshot import snapshot_of
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.replica_stats import ReplicaStatsPoller
from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)
REFRESH_S = 1.0  # the page polls this often; readings are kept at most this often


def thresholds(config: RouterConfig) -> tiles.Thresholds:
    return tiles.Thresholds(
        ttft_s=config.slo_ttft_s, tpot_s=config.slo_tpot_s, e2e_s=config.dashboard_e2e_slo_s,
        min_slo_attainment=config.dashboard_min_slo_attainment, max_kv_usage=config.dashboard_max_kv_usage,
        max_error_rate=config.dashboard_max_error_rate, max_fallback_rate=config.dashboard_max_fallback_rate,
        max_waiting_per_replica=config.dashboard_max_waiting_per_replica,
        min_live_replicas=config.dashboard_min_live_replicas)


class RouterDashboard:
    def __init__(
        self, config: RouterConfig, registry: CollectorRegistry, worker_snapshots: dict[str, tuple[float, dict]],
        poller: ReplicaStatsPoller, refresh_workers: Callable[[], Awaitable[Any]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`worker_snapshots`: the router's cache (replica -> (monotonic time, snapshot)), filled by
        `refresh_workers`; the roles shown are those the poller watches (the mode's, as /health counts)."""
        self.config = config
        self.thresholds = thresholds(config)
        self.registry = registry
        self.worker_snapshots = worker_snapshots
        self.poller = poller
        self.roles = poller.deployments
        self.refresh_workers = refresh_workers
        self.clock = clock
        self.readings: deque[tiles.Reading] = deque()
        self._refresh: asyncio.Task | None = None
        self._refreshed_at = -float("inf")

    def data(self) -> dict[str, Any]:
        now = self.clock()
        self.poller.start()
        self._maybe_refresh_workers(now)
        live_ids = {role: {s.replica for s in self.poller.snapshots(role)} for role in self.roles}
        polled = self.poller.polled is not None and self.poller.polled.is_set()
        live = {role: len(ids) if polled else None for role, ids in live_ids.items()}
        alive = set().union(*live_ids.values())
        workers = [snap for replica, (_, snap) in list(self.worker_snapshots.items()) if replica in alive]
        snapshots = [snapshot_of(self.registry), *workers]
        current = tiles.reading(now, snapshots)
        base = self._keep(current)
        span = current.at - base.at if base is not None else 0.0
        seen = [at for at, _ in self.worker_snapshots.values()]
        return {
            "model": self.config.served_model_name, "mode": self.config.mode, "generated_at": time.time(),
            "refresh_s": REFRESH_S,
            "window": {"seconds": round(span, 3), "max_seconds": self.config.slo_window_s,
                       "slo_window_s": self.config.slo_window_s},
            "workers_age_s": round(now - max(seen), 3) if seen else None,
            "tiles": tiles.tile_dicts(tiles.tiles(current, base, snapshots, live, self.thresholds)),
        }

    def _keep(self, current: tiles.Reading) -> tiles.Reading | None:
        """Keeps `current` (at most one reading per REFRESH_S) and returns the oldest reading within the
        window before it: the base of the rates and percentiles."""
        horizon = current.at - self.config.slo_window_s
        while self.readings and self.readings[0].at < horizon:
            self.readings.popleft()
        base = self.readings[0] if self.readings else None
        if not self.readings or current.at - self.readings[-1].at >= REFRESH_S:
            self.readings.append(current)
        return base

    def _maybe_refresh_workers(self, now: float) -> None:
        """At most one refresh per `dashboard_worker_refresh_s`, however often the page polls, and none
        while snapshots that young are cached (a /metrics scrape refreshed them)."""
        every = self.config.dashboard_worker_refresh_s
        newest = max((at for at, _ in list(self.worker_snapshots.values())), default=-every)
        if now - max(newest, self._refreshed_at) < every or (self._refresh is not None and not self._refresh.done()):
            return
        self._refreshed_at = now
        self._refresh = asyncio.get_running_loop().create_task(self._refresh_quietly())

    async def _refresh_quietly(self) -> None:
        try:
            await self.refresh_workers()
        except Exception:  # a failed refresh leaves the cache to age; a later poll tries again
            logger.debug("worker snapshot refresh failed", exc_info=True)
