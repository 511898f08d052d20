"""Live stats of every prefill and decode replica, polled by the router with a staleness bound.

Serve pushes `record_routing_stats` to handles only every few seconds; placement needs fresher
numbers, so the router polls each replica itself every `period_s` (replicas are found by Serve's actor
naming, `SERVE_REPLICA::{app}#{deployment}#{id}`, refreshed every `discover_every_s`). The first poll
calls the replica actor's `record_routing_stats`, whose reply names the replica's worker link; later
polls are one STATS call over that link (stats and KV events in one round trip), and go back to the
actor whenever the link fails. A snapshot older than `staleness_s` is reported with its age, and a
replica that stopped answering drops out after `2 * staleness_s`, one whose actor died at once.

With a prefix index, each poll also reads every replica's KV events after the index's cursor (in the
link's STATS reply, or by `kv_events` through the deployment's handle, steered to the replica by
PlacementRequestRouter; a reply from any other replica is dropped) and applies them to the index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError

from pdserve.kv_events import KVEventBatch
from pdserve.placement.prefix_index import PrefixIndex
from pdserve.worklink import Link, LinkClient

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
        index: PrefixIndex | None = None, links: LinkClient | None = None,
        on_poll: Callable[[str, str], None] | None = None,
    ) -> None:
        """`links`: poll over the replicas' worker links once known (None: always through Serve);
        `on_poll(role, path)` is told each answered poll ("link" or "serve")."""
        self.app_name = app_name
        self.links = links
        self.on_poll = on_poll
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
        await asyncio.gather(*(self._poll_one(*key) for key in list(self._actors)), return_exceptions=True)

    async def _poll_one(self, deployment: str, replica: str) -> None:
        """One replica's stats (and KV events, with a prefix index): over its worker link once its stats
        have named one, else (and whenever the link fails but for a timeout) through its actor."""
        key = (deployment, replica)
        want_events = self.index is not None and deployment in self.kv_sources
        link = self._link(key)
        if link is not None:
            cursor = self.index.cursor(replica) if want_events else None
            try:
                reply = await asyncio.wait_for(self.links.stats(link, want_events, cursor), self.staleness_s)
            except TimeoutError:  # a replica too busy to answer: its snapshot ages, as with a slow actor call
                return
            except Exception as exc:  # gone, restarted with a new token, or broken: ask its actor
                logger.debug("stats over the link to %s failed: %s: %s", replica, type(exc).__name__, exc)
            else:
                if reply.get("replica") == replica:
                    events = reply.pop("kv_events", None)
                    self._store(key, {**reply, "link": link.address, "link_token": link.token})
                    if events is not None:
                        self._apply_events(replica, events)
                    self._count(deployment, "link")
                    return
        actor = self._actors.get(key)
        if actor is None:
            return
        try:
            reply = await asyncio.wait_for(actor.record_routing_stats.remote(), self.staleness_s)
        except RayActorError:  # dead: out of placement, /health and /metrics at once
            self.forget(deployment, replica)
            return
        if isinstance(reply, dict) and reply:
            self._store(key, reply)
            self._count(deployment, "serve")
        if want_events:
            await self._read_events(deployment, replica)

    def link(self, role: str, replica: str) -> Link | None:
        """The replica's worker link while it still answers; None: no link (call it through Serve)."""
        return self._link((role, replica)) if self.latest(role, replica) is not None else None

    def _link(self, key: tuple[str, str]) -> Link | None:
        latest = self._latest.get(key)
        if self.links is None or latest is None or not latest.stats.get("link"):
            return None
        return Link(latest.stats["link"], latest.stats.get("link_token", ""))

    def _store(self, key: tuple[str, str], stats: dict[str, Any]) -> None:
        self._latest[key] = ReplicaStats(key[1], key[0], stats, time.monotonic())

    def _count(self, deployment: str, path: str) -> None:
        if self.on_poll is not None:
            self.on_poll(deployment, path)

    def _apply_events(self, replica: str, reply: dict[str, Any]) -> None:
        if reply.get("replica") == replica:
            self.index.apply(replica, KVEventBatch.from_dict(reply), reply.get("layout_hash"))

    async def _read_events(self, deployment: str, replica: str) -> None:
        target = {"replica": replica, "cursor": self.index.cursor(replica)}
        reply = await asyncio.wait_for(self.kv_sources[deployment].kv_events.remote(target), self.staleness_s)
        if isinstance(reply, dict):  # a reply from another replica (Serve steered it elsewhere) is dropped
            self._apply_events(replica, reply)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
