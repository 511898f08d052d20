"""The KV transport of a tensor-parallel replica that hands no KV (`WorkerConfig.kv_handoff` false: a
colocated app without the Redis tier): none, so that it keeps no whole-model pool for handoffs. A call
that comes anyway fails as a transfer does (the importer falls back to a local prefill)."""

from __future__ import annotations

from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.transports.base import KVTransferError, KVTransport

REASON = "this replica hands no KV (kv_handoff false: a colocated app without the Redis tier)"


class NoHandoff(KVTransport):
    name = "none"

    async def export(self, lease_id: str, block_ids: list[int], block_hashes: list[int],
                     num_tokens: int) -> HandoffParams:
        raise KVTransferError(REASON)

    async def pull(self, params: HandoffParams, dest_block_ids: list[int]) -> str | None:
        raise KVTransferError(REASON)
