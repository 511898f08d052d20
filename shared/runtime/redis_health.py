"""The Redis tier's health and settings: a background probe whose state readers take without waiting
(`/health`, `pdserve_redis_up`), and the eviction settings applied and read back (CONFIG SET / GET)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

logger = logging.getLogger(__name__)


def redact_url(url: str) -> str:
    """The URL with its password replaced by ***, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{parts.hostname or ''}{port}"))


class RedisSettingsError(RuntimeError):
    """Redis refused or did not keep the kvstore's settings (CONFIG disabled, a managed service, a typo)."""


def redis_settings(maxmemory_bytes: int | None, maxmemory_policy: str | None) -> dict[str, str]:
    """The server settings for the kvstore's config (KVStoreConfig): only those it sets."""
    settings = {}
    if maxmemory_bytes is not None:
        settings["maxmemory"] = str(int(maxmemory_bytes))
    if maxmemory_policy is not None:
        settings["maxmemory-policy"] = maxmemory_policy
    return settings


def settings_mismatch(wanted: Mapping[str, str], found: Mapping[Any, Any]) -> list[str]:
    """What CONFIG GET (`found`, str or bytes keys and values) says differs from `wanted`."""
    got = {_text(k): _text(v) for k, v in found.items()}
    return [f"{name} is {got.get(name)!r}, wanted {value!r}" for name, value in wanted.items() if got.get(name) != value]


def check_settings(client: redis.Redis, wanted: Mapping[str, str], where: str) -> None:
    """Reads `wanted` back with CONFIG GET; RedisSettingsError if any differs or CONFIG is refused."""
    try:
        found = {name: value for name in wanted for name, value in client.config_get(name).items()}
    except redis.RedisError as exc:
        raise RedisSettingsError(f"cannot read the settings of Redis at {where}: {exc}") from exc
    if wrong := settings_mismatch(wanted, found):
        raise RedisSettingsError(f"Redis at {where} did not take its settings: {'; '.join(wrong)}")


async def apply_settings(client: aioredis.Redis, wanted: Mapping[str, str], where: str) -> None:
    """CONFIG SET each of `wanted`, then read them back; RedisSettingsError (with what failed) otherwise."""
    try:
        for name, value in wanted.items():
            await client.config_set(name, value)
        found = {}
        for name in wanted:
            found.update(await client.config_get(name))
    except (redis.ConnectionError, redis.TimeoutError):
        raise  # unreachable, not refused: the caller retries later
    except redis.RedisError as exc:
        raise RedisSettingsError(f"Redis at {where} refused the kvstore settings {dict(wanted)}: {exc}") from exc
    if wrong := settings_mismatch(wanted, found):
        raise RedisSettingsError(f"Redis at {where} did not take the kvstore settings: {'; '.join(wrong)}")


class RedisProbe:
    """Pings Redis every `interval_s` from a background task; `up` (None until the first answer or
    failure) is what readers use, so they never wait on Redis. Transitions are logged with the error."""

    def __init__(self, url: str, interval_s: float = 0.5, timeout_s: float = 0.5) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval_s and timeout_s must be positive")
        self.url = url
        self.safe_url = redact_url(url)
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.up: bool | None = None
        self.changed_at = time.monotonic()
        self.num_outages = 0
        self._task: asyncio.Task | None = None
        self._client = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                         retry=Retry(NoBackoff(), 0))

    @property
    def status(self) -> str:
        return "unknown" if self.up is None else "up" if self.up else "down"

    def state(self) -> dict[str, Any]:
        """Plain data for /health: status and seconds in it (no address, no error text: those go to logs)."""
        return {"status": self.status, "for_s": round(time.monotonic() - self.changed_at, 1)}

    def start(self) -> None:
        """Starts the probe on the running event loop (idempotent; a no-op outside one)."""
        if self._task is not None and not self._task.done():
            return
        try:
            self._task = asyncio.get_running_loop().create_task(self._run())
        except RuntimeError:
            pass

    async def probe_once(self) -> bool:
        try:
            is_up = bool(await asyncio.wait_for(self._client.ping(), self.timeout_s))
            error = None
        except (redis.RedisError, OSError, TimeoutError) as exc:
            is_up, error = False, f"{type(exc).__name__}: {exc}"
        self._set(is_up, error)
        return is_up

    async def _run(self) -> None:
        while True:
            await self.probe_once()
            await asyncio.sleep(self.interval_s)

    def _set(self, is_up: bool, error: str | None) -> None:
        if is_up == self.up:
            return
        if is_up:
            (logger.info if self.up is None else logger.warning)("Redis at %s is up", self.safe_url)
        else:
            self.num_outages += 1
            logger.error("Redis at %s is down: %s", self.safe_url, error)
        self.up, self.changed_at = is_up, time.monotonic()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._client.aclose()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
