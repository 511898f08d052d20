"""Same-process handoff: block copies between two pools that share a LocalHub (colocated mode, tests)."""

from __future__ import annotations

import hmac
import secrets
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
    secret: str


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
        secret = secrets.token_hex(16)
        self.hub.exports[lease_id] = _Export(self.pool, list(block_ids), self.release, secret)
        return HandoffParams("local", self.layout.layout_hash, lease_id, num_tokens, tuple(block_ids),
                             tuple(block_hashes), secret=secret)

    def forget(self, lease_id: str) -> bool:
        export = self.hub.exports.get(lease_id)
        if export is None or export.pool is not self.pool:
            return False
        del self.hub.exports[lease_id]
        return True

    def exported_lease_ids(self) -> list[str]:
        return [lease_id for lease_id, export in self.hub.exports.items() if export.pool is self.pool]

    async def pull(self, params: HandoffParams, dest_block_ids: list[int]) -> None:
        self._check_pull(params, dest_block_ids)
        export = self.hub.exports.get(params.lease_id)
        if export is None or not hmac.compare_digest(params.secret.encode(), export.secret.encode()):
            raise KVTransferError(f"no local export for lease {params.lease_id!r} (expired, aborted or pulled)")
        del self.hub.exports[params.lease_id]
        if export.block_ids != list(params.block_ids):
            raise KVTransferError("handoff block ids do not match the export")
        for src, dst in zip(export.block_ids, dest_block_ids):
            self.pool.block_tensor(dst).copy_(export.pool.block_tensor(src))
        self.bytes_pulled += len(dest_block_ids) * self.pool.block_nbytes
        if export.release is not None:
            await export.release(params.lease_id)
