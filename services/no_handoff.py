"""The KV transport of a tensor-parallel replica: none. Each rank's pool holds only its own heads and no
transport moves per-rank head ranges yet, so nothing is exported or pulled; SystemConfig keeps such a
replica out of every handoff (colocated mode, no Redis prefix pulls), and a call that comes anyway fails
as a transfer does (the importer falls back to a local prefill)."""

from __future__ import annotations

from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.transports.base import KVTransferError, KVTransport

REASON = "KV handoff between tensor-parallel replicas is not implemented yet (each rank pools only its own heads)"


class NoHandoff(KVTransport):
    name = "none"

    async def export(self, lease_id: str, block_ids: list[int], block_hashes: list[int],
                     num_tokens: int) -> HandoffParams:
        raise KVTransferError(REASON)

    async def pull(self, params: HandoffParams, dest_block_ids: list[int]) -> str | None:
        raise KVTransferError(REASON)
