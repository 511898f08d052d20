"""The Redis tier's health as the router sees it: the kvstore deployment probes Redis (RedisProbe) and
this watch polls that state in the background, so `/health` and `pdserve_redis_up` read it without
waiting on Redis or on the kvstore replica."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)


class RedisTierWatch:
    """`up` is None until the kvstore first reports, and again once it has not answered for `stale_s`
    (a dead kvstore replica means the tier's state is unknown, not up)."""

    def __init__(self, kvstore: Any, interval_s: float = 0.5, timeout_s: float = 1.0, stale_s: float = 3.0) -> None:
        self.kvstore = kvstore
        self.interval_s, self.timeout_s, self.stale_s = interval_s, timeout_s, stale_s
        self._state: dict[str, Any] = {"status": "unknown"}
        self._received_at = -1e9
        self._task: asyncio.Task | None = None

    @property
    def up(self) -> bool | None:
        status = self.state()["status"]
        return None if status == "unknown" else status == "up"

    def state(self) -> dict[str, Any]:
        """{"status": "up" | "down" | "unknown", "for_s": seconds in it (when known)}."""
        if time.monotonic() - self._received_at > self.stale_s:
            return {"status": "unknown"}
        return dict(self._state)

    def start(self) -> None:
        """Starts polling on the running event loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                state = await asyncio.wait_for(self.kvstore.health.remote(), self.timeout_s)
                self._state, self._received_at = dict(state), time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a kvstore that does not answer: the state goes stale
                logger.debug("kvstore health poll failed: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
