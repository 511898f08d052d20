"""UCX across nodes, shared memory within one: the default point-to-point transport of a worker."""

from __future__ import annotations

import logging
from collections import Counter
from typing import ClassVar

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports.base import KVTransport, ReleaseFn
from pdserve.kvcache.transports.shm import ShmTransport, ShmUnreachable

logger = logging.getLogger(__name__)


class SameHostFirst(KVTransport):
    """Exports over `remote` and shares every export with `local`, under the same lease and secret; the
    params then carry this node's id and the shared-memory address beside the remote one. An importer
    pulls through shared memory when the params name its own node, over `remote` otherwise, and over
    `remote` too when the exporter's shared-memory socket cannot be reached (nothing was asked of it).

    A lease is served once: the shared-memory side withdraws it from `remote` (`remote.forget`) before it
    copies a block, and a pull completed over `remote` withdraws it from `local`. Both sub-transports are
    rewired here (their release callbacks), so they belong to this one.
    """

    name: ClassVar[str] = "ucx"

    def __init__(
        self, pool: KVPoolIO, layout: KVLayout, release: ReleaseFn | None = None, *,
        remote: KVTransport, local: ShmTransport,
    ) -> None:
        super().__init__(pool, layout, release)
        if remote.pool is not pool or local.pool is not pool:
            raise ValueError("both sub-transports must work on this transport's pool")
        self.remote, self.local = remote, local
        remote.release = self._released_remotely
        local.release = release
        local.on_claim = remote.forget
        self.pulls_by_path: Counter[str] = Counter()  # "shm", the remote's name, "shm_unreachable"

    async def start(self) -> None:
        await self.remote.start()
        if self.local.is_available:
            await self.local.start()

    async def close(self) -> None:
        await self.local.close()
        await self.remote.close()

    async def export(self, lease_id: str, block_ids: list[int], block_hashes: list[int], num_tokens: int) -> HandoffParams:
        params = await self.remote.export(lease_id, block_ids, block_hashes, num_tokens)
        return self.local.share(params) if self.local.is_available else params

    async def _released_remotely(self, lease_id: str) -> None:
        self.local.forget(lease_id)
        if self.release is not None:
            await self.release(lease_id)

    async def pull(self, params: HandoffParams, dest_block_ids: list[int]) -> str:
        if self.local.is_local(params):
            try:
                return await self._pull_over(self.local, params, dest_block_ids)
            except ShmUnreachable as e:
                self.pulls_by_path["shm_unreachable"] += 1
                logger.info("%s; pulling lease %s over %s instead", e, params.lease_id, self.remote.name)
        return await self._pull_over(self.remote, params, dest_block_ids)

    async def _pull_over(self, transport: KVTransport, params: HandoffParams, dest_block_ids: list[int]) -> str:
        before = transport.bytes_pulled
        await transport.pull(params, dest_block_ids)
        self.bytes_pulled += transport.bytes_pulled - before
        self.pulls_by_path[transport.name] += 1
        return transport.name

    def forget(self, lease_id: str) -> bool:
        is_remote = self.remote.forget(lease_id)
        is_local = self.local.forget(lease_id)
        return is_remote or is_local

    def exported_lease_ids(self) -> list[str]:
        return list(dict.fromkeys([*self.remote.exported_lease_ids(), *self.local.exported_lease_ids()]))
