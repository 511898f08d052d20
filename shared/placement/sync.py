"""Placement sync: what each router placed reaches the other routers before the next stats poll.

Between two polls a router knows the replicas' polled stats plus its own pending placements; the other
routers' placements since the poll are invisible to it, so with a shared stale view every router picks
the same best replica (herding). Each router publishes its placements as pending entries (replica,
prefill tokens, blocks, age) and records the others' in its own PendingPlacements, where stats taken
after they landed clear them, exactly as they clear its own.

Wire format (JSON, never pickle; malformed messages are dropped):
`{"v": 1, "router": id, "sent_at": unix seconds, "entries": [[replica, prefill_tokens, blocks, age_s], ...]}`
Each router sends at most one message per `flush_s`; a message costs one PUBLISH, fanned out by Redis.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

WIRE_VERSION = 1
RemoteEntry = tuple[str, int, int, float]  # replica, prefill tokens, blocks, placed_at (receiver's monotonic clock)
OnRemote = Callable[[list[RemoteEntry]], None]


class PlacementSync(ABC):
    """Shares this router's placements with the other routers of the same app."""

    name: str

    def __init__(self) -> None:
        self.router_id = uuid.uuid4().hex[:12]
        self.num_sent = self.num_received = self.num_dropped = 0

    @abstractmethod
    def publish(self, entries: list[tuple[str, int, int]]) -> None:
        """Entries this router just placed (PendingPlacements.record_placement's return); never blocks."""

    @abstractmethod
    def start(self, on_remote: OnRemote) -> None:
        """From the router's event loop: deliver the other routers' entries to `on_remote`."""

    @abstractmethod
    async def close(self) -> None: ...


class NoSync(PlacementSync):
    name = "none"

    def publish(self, entries: list[tuple[str, int, int]]) -> None:
        pass

    def start(self, on_remote: OnRemote) -> None:
        pass

    async def close(self) -> None:
        pass


def encode(router_id: str, entries: list[tuple[str, int, int, float]], now_wall: float) -> str:
    return json.dumps({"v": WIRE_VERSION, "router": router_id, "sent_at": now_wall,
                       "entries": [[r, p, b, round(age, 6)] for r, p, b, age in entries]})


def decode(raw: bytes | str, own_id: str, now_wall: float, now_mono: float) -> list[RemoteEntry] | None:
    """The entries of another router's message, placed_at on this process's monotonic clock; [] for this
    router's own messages; None for a malformed one. Transit time is taken from the wall clocks, at
    least 0 (routers on one host share a clock; across hosts NTP keeps them within milliseconds)."""
    try:
        msg = json.loads(raw)
        if not isinstance(msg, dict) or msg.get("v") != WIRE_VERSION or not isinstance(msg.get("entries"), list):
            return None
        if msg.get("router") == own_id:
            return []
        transit = max(0.0, now_wall - float(msg["sent_at"]))
        out = []
        for replica, prefill_tokens, blocks, age in msg["entries"]:
            if not (isinstance(replica, str) and type(prefill_tokens) is int and type(blocks) is int):
                return None
            if prefill_tokens < 0 or blocks < 0 or not 0 <= float(age) < 3600:
                return None
            out.append((replica, prefill_tokens, blocks, now_mono - transit - float(age)))
        return out
    except (ValueError, TypeError, KeyError):
        return None


class RedisPlacementSync(PlacementSync):
    """Pub/sub on one Redis channel per app (redis.asyncio): a PUBLISH per flush, a subscriber task that
    reconnects with backoff. Its failures never reach placement: a router without sync places on its
    own view, as before."""

    name = "redis"

    def __init__(self, redis_url: str, channel: str, flush_s: float = 0.002) -> None:
        super().__init__()
        self.redis_url, self.channel, self.flush_s = redis_url, channel, flush_s
        self._buffer: list[tuple[str, int, int, float]] = []
        self._flush: asyncio.TimerHandle | None = None
        self._client: Any = None
        self._tasks: set[asyncio.Task] = set()
        self._closed = self._subscribed = False

    def _redis(self) -> Any:
        if self._client is None:
            import redis.asyncio as aioredis

            self._client = aioredis.from_url(self.redis_url, socket_connect_timeout=1.0, socket_timeout=1.0)
        return self._client

    def publish(self, entries: list[tuple[str, int, int]]) -> None:
        if self._closed or not entries:
            return
        now = time.monotonic()
        self._buffer += [(replica, prefill, blocks, now) for replica, prefill, blocks in entries]
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self.flush_s, self._send)

    def _send(self) -> None:
        self._flush = None
        now = time.monotonic()
        batch, self._buffer = self._buffer, []
        message = encode(self.router_id, [(r, p, b, now - t) for r, p, b, t in batch], time.time())
        self._spawn(self._publish(message))

    async def _publish(self, message: str) -> None:
        try:
            await self._redis().publish(self.channel, message)
            self.num_sent += 1
        except Exception as exc:  # Redis down: this router's placements stay local until it is back
            self.num_dropped += 1
            logger.debug("placement sync publish failed: %s: %s", type(exc).__name__, exc)

    def start(self, on_remote: OnRemote) -> None:
        if not self._subscribed and not self._closed:
            self._subscribed = True
            self._spawn(self._subscribe(on_remote))

    async def _subscribe(self, on_remote: OnRemote) -> None:
        backoff = 0.1
        while not self._closed:
            pubsub = self._redis().pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                backoff = 0.1
                while not self._closed:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None or message.get("type") != "message":
                        continue
                    entries = decode(message["data"], self.router_id, time.time(), time.monotonic())
                    if entries is None:
                        self.num_dropped += 1
                    elif entries:
                        self.num_received += 1
                        on_remote(entries)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.debug("placement sync subscription lost: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, 5.0)
            finally:
                await asyncio.shield(pubsub.aclose())

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self._closed = True
        if self._flush is not None:
            self._flush.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()


def create_sync(name: str, redis_url: str | None, channel: str, flush_s: float) -> PlacementSync:
    """`name`: none | redis | auto (redis when there is a Redis, else none)."""
    if name == "auto":
        name = "redis" if redis_url else "none"
    if name == "none":
        return NoSync()
    if name == "redis":
        if not redis_url:
            raise ValueError("placement sync over redis needs a Redis (redis_url)")
        return RedisPlacementSync(redis_url, channel, flush_s)
    raise ValueError(f"unknown placement sync {name!r}; known: auto, none, redis")
