"""Ray Serve deployment of the kvstore and its `build_app(config) -> Application`."""

from __future__ import annotations

import logging
from typing import Any

from ray import serve
from ray.serve import Application

from pdserve.runtime.redis_health import RedisProbe, RedisSettingsError
from pdserve.services.kvstore.config import KVStoreConfig
from pdserve.services.kvstore.store import KVStore, KVStoreUnavailable


logger = logging.getLogger(__name__)


@serve.deployment(name="kvstore", ray_actor_options={"num_cpus": 0})
class KVStoreDeployment:
    """Thin Serve wrapper: the router and workers call it through Serve handles."""

    def __init__(self, config: dict[str, Any], store: KVStore | None = None) -> None:
        self.config = KVStoreConfig.model_validate(config)
        self.store = store or KVStore(self.config)
        self.is_policy_applied = False
        self.probe = RedisProbe(self.config.redis_url)  # started on the replica's loop by the first health()

    async def _ensure_policy(self) -> None:
        # Applied lazily (and retried until it takes) so a Redis that is down at startup does not crash the replica.
        if not self.is_policy_applied:
            try:
                await self.store.apply_policy()
                self.is_policy_applied = True
            except KVStoreUnavailable:
                pass
            except RedisSettingsError as exc:  # permanent (CONFIG refused, a managed Redis): say so once
                logger.error("%s; the kvstore runs with the server's own eviction settings", exc)
                self.is_policy_applied = True

    async def lookup_prefix(self, layout_hash: int, block_hashes: list[int]) -> int:
        """Leading blocks of the chain present in the store; 0 when Redis is unreachable."""
        await self._ensure_policy()
        try:
            return await self.store.lookup_prefix(int(layout_hash), [int(h) for h in block_hashes])
        except KVStoreUnavailable:
            return 0

    async def stats(self) -> dict[str, Any]:
        await self._ensure_policy()
        try:
            return {"healthy": True, **await self.store.stats()}
        except KVStoreUnavailable as exc:
            return {"healthy": False, "error": str(exc)}

    async def health(self) -> dict[str, Any]:
        """The Redis probe's state ({"status": "up" | "down" | "unknown", "for_s"}), without waiting on
        Redis: the probe pings in the background."""
        self.probe.start()
        return self.probe.state()

    async def __del__(self) -> None:
        """Serve's graceful shutdown: the probe and the store's Redis connections."""
        await self.probe.close()
        await self.store.close()

    async def check_health(self) -> None:
        # Serve's replica health check; an unreachable Redis degrades lookups but keeps the replica.
        return None


def build_app(config: KVStoreConfig | dict[str, Any]) -> Application:
    cfg = config if isinstance(config, KVStoreConfig) else KVStoreConfig.model_validate(config)
    return KVStoreDeployment.options(num_replicas=cfg.num_replicas).bind(cfg.model_dump())
