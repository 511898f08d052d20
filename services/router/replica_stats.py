"""Live stats of every prefill and decode replica, polled by the router with a staleness bound.

Serve pushes `record_routing_stats` to handles only every few seconds; placement needs fresher
numbers, so the router calls each replica actor's `record_routing_stats` itself every `period_s`
(replicas are found by Serve's actor naming, `SERVE_REPLICA::{app}#{deployment}#{id}`, refreshed
every `discover_every_s`). A snapshot older than `staleness_s` is reported with its age, and a
replica that stopped answering drops out after `2 * staleness_s`, one whose actor died at once.

With a prefix index, each poll also reads every replica's KV events after the index's cursor
(`kv_events`, through the deployment's handle, steered to the replica by PlacementRequestRouter; a
reply from any other replica is dropped) and applies them to the index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any

from ray.exceptions import RayActorError

from pdserve.kv_events import KVEventBatch
from pdserve.services.router.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)
PREFIX = "SERVE_REPLICA::"


@dataclass(frozen=True)
class ReplicaStats:
    replica: str
    role: str
    stats: dict[str, Any]
    received_at: float  # time.monotonic()


class ReplicaStatsPoller:
    def __init__(
        self, app_name: str, deployments: tuple[str, ...], period_s: float = 0.1, staleness_s: float = 1.0,
        discover_every_s: float = 2.0, kv_sources: Mapping[str, Any] | None = None,
        index: PrefixIndex | None = None,
    ) -> None:
        self.app_name = app_name
        self.kv_sources = {role: h for role, h in (kv_sources or {}).items() if h is not None}  # role -> handle
        self.index = index
        self.deployments = deployments
        self.period_s = period_s
        self.staleness_s = staleness_s
        self.discover_every_s = discover_every_s
        self._actors: dict[tuple[str, str], Any] = {}  # (deployment, replica id) -> actor handle
        self._latest: dict[tuple[str, str], ReplicaStats] = {}
        self._task: asyncio.Task | None = None
        self.polled: asyncio.Event | None = None  # set once the first discovery and poll are done

    def start(self) -> None:
        if self._task is None or self._task.done():
            self.polled = self.polled or asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def ready(self, timeout_s: float) -> bool:
        """Starts polling if needed and waits (at most `timeout_s`) for the first round."""
        self.start()
        try:
            await asyncio.wait_for(asyncio.shield(self.polled.wait()), timeout_s)
        except TimeoutError:
            pass
        return self.polled.is_set()

    def forget(self, role: str, replica: str) -> None:
        """Drops a replica known to be dead until discovery finds it alive again."""
        self._latest.pop((role, replica), None)
        self._actors.pop((role, replica), None)

    def snapshots(self, role: str) -> list[ReplicaStats]:
        """The latest stats of each replica of `role` still answering, freshest first."""
        now = time.monotonic()
        out = [s for (dep, _), s in self._latest.items() if dep == role and now - s.received_at <= 2 * self.staleness_s]
        return sorted(out, key=lambda s: -s.received_at)

    def latest(self, role: str, replica: str) -> ReplicaStats | None:
        """The replica's latest stats while it still answers."""
        s = self._latest.get((role, replica))
        return s if s is not None and time.monotonic() - s.received_at <= 2 * self.staleness_s else None

    async def _run(self) -> None:
        last_discovery = -1e9
        while True:
            try:
                if time.monotonic() - last_discovery > self.discover_every_s:
                    await self._discover()
                    last_discovery = time.monotonic()
                await self._poll()
                self.polled.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a poll that fails leaves the last snapshots to age out
                logger.debug("replica stats poll failed: %s", exc)
            await asyncio.sleep(self.period_s)

    async def _discover(self) -> None:
        import ray

        names = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        found: dict[tuple[str, str], Any] = {}
        for entry in names:
            name = entry["name"]
            if not name.startswith(PREFIX):
                continue
            parts = name[len(PREFIX):].split("#")
            if len(parts) != 3 or parts[0] != self.app_name or parts[1] not in self.deployments:
                continue
            key = (parts[1], parts[2])
            found[key] = self._actors.get(key) or ray.get_actor(name, namespace=entry["namespace"])
        self._actors = found
        for key in list(self._latest):
            if key not in found:
                del self._latest[key]
                if self.index is not None:
                    self.index.forget(key[1])

    async def _poll(self) -> None:
        keys = list(self._actors)
        events = [k for k in keys if self.index is not None and k[0] in self.kv_sources]
        replies = await asyncio.gather(
            *(asyncio.wait_for(self._actors[k].record_routing_stats.remote(), self.staleness_s) for k in keys),
            *(self._read_events(*k) for k in events),
            return_exceptions=True,
        )
        now = time.monotonic()
        for (deployment, replica), reply in zip(keys, replies):
            if isinstance(reply, dict) and reply:
                self._latest[(deployment, replica)] = ReplicaStats(replica, deployment, reply, now)
            elif isinstance(reply, RayActorError):  # dead: out of placement, /health and /metrics at once
                self.forget(deployment, replica)

    async def _read_events(self, deployment: str, replica: str) -> None:
        target = {"replica": replica, "cursor": self.index.cursor(replica)}
        reply = await asyncio.wait_for(self.kv_sources[deployment].kv_events.remote(target), self.staleness_s)
        if isinstance(reply, dict) and reply.get("replica") == replica:
            self.index.apply(replica, KVEventBatch.from_dict(reply), reply.get("layout_hash"))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
