"""Same-process handoff: block copies between two pools that share a LocalHub (colocated mode, tests)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports.base import KVTransferError, KVTransport, ReleaseFn


@dataclass
class _Export:
    pool: KVPoolIO
    block_ids: list[int]
    release: ReleaseFn | None


@dataclass
class LocalHub:
    """The exports of every LocalTransport in one process that should see each other."""

    exports: dict[str, _Export] = field(default_factory=dict)


class LocalTransport(KVTransport):
    name = "local"

    def __init__(self, pool: KVPoolIO, layout: KVLayout, release: ReleaseFn | None = None, *, hub: LocalHub | None = None) -> None:
        super().__init__(pool, layout, release)
        self.hub = hub or LocalHub()

    async def export(self, lease_id: str, block_ids: list[int], block_hashes: list[int], num_tokens: int) -> HandoffParams:
        self.hub.exports[lease_id] = _Export(self.pool, list(block_ids), self.release)
        return HandoffParams("local", self.layout.layout_hash, lease_id, num_tokens, tuple(block_ids), tuple(block_hashes))

    def forget(self, lease_id: str) -> bool:
        return self.hub.exports.pop(lease_id, None) is not None

    async def pull(self, params: HandoffParams, dest_block_ids: list[int]) -> None:
        self._check_pull(params, dest_block_ids)
        export = self.hub.exports.pop(params.lease_id, None)
        if export is None:
            raise KVTransferError(f"no local export for lease {params.lease_id!r} (expired, aborted or pulled)")
        if export.block_ids != list(params.block_ids):
            raise KVTransferError("handoff block ids do not match the export")
        for src, dst in zip(export.block_ids, dest_block_ids):
            self.pool.block_tensor(dst).copy_(export.pool.block_tensor(src))
        self.bytes_pulled += len(dest_block_ids) * self.pool.block_nbytes
        if export.release is not None:
            await export.release(params.lease_id)
