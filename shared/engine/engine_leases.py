"""The KV an engine lends and borrows under leases: blocks reserved for a pull, a prefill's handed off,
blocks cached from a shared store, leases expired; and, on a tensor-parallel replica, the moves between
its ranks and the whole-model pool the transports use (pdserve.engine.tp_kv)."""

from __future__ import annotations

import torch

from pdserve.engine.lease import Lease
from pdserve.engine.outputs import KVHandoff, TokenDelta
from pdserve.engine.sequence import Sequence


class EngineLeases:
    """LLMEngine's lease methods; reads its block_manager, leases, scheduler, runner and sharded_kv."""

    def reserve_kv(self, num_tokens: int) -> Lease:
        """Allocate blocks for KV that a transport will write (decode side of a handoff)."""
        block_ids = self.block_manager.allocate_blocks((num_tokens + self.block_manager.block_size - 1) // self.block_manager.block_size)
        return self.leases.grant(block_ids, num_tokens)

    def release_lease(self, lease_id: str) -> bool:
        try:
            lease = self.leases.take(lease_id)
        except KeyError:
            return False
        self.block_manager.release_blocks(list(lease.block_ids))
        return True

    def cache_lease(self, lease_id: str, block_hashes: list[int]) -> int:
        """End a lease whose blocks hold known KV (pulled from a shared store, block i under
        `block_hashes[i]`) by releasing them into the prefix cache; returns the blocks cached."""
        lease = self.leases.take(lease_id)
        if len(block_hashes) != len(lease.block_ids):
            self.block_manager.release_blocks(list(lease.block_ids))
            raise ValueError(f"{len(block_hashes)} hashes for {len(lease.block_ids)} leased blocks")
        if self.sharded_kv is not None:
            self.sharded_kv.scatter(lease.block_ids)
        return self.block_manager.cache_blocks(list(lease.block_ids), list(block_hashes))

    def expire_leases(self, now: float | None = None) -> int:
        expired = self.leases.expired(now)
        for lease in expired:
            self.block_manager.release_blocks(list(lease.block_ids))
        self.num_expired_leases += len(expired)
        return len(expired)

    @property
    def handoff_pool(self) -> torch.Tensor:
        """The pool a KV transport reads and writes: the runner's, or a TP replica's whole-model pool."""
        return self.runner.kv_pool if self.sharded_kv is None else self.sharded_kv.canonical

    def _gather_handed_off(self, outputs: list[TokenDelta]) -> None:
        """The blocks this step's parts and handoffs lease out, from every rank into the canonical pool."""
        for d in outputs:
            if d.kv_part is not None:
                self.sharded_kv.gather(d.kv_part.block_ids)
            if d.kv_handoff is not None:
                self.sharded_kv.gather(d.kv_handoff.block_ids[d.kv_handoff.num_parted_blocks:])

    def _hand_off(self, seq: Sequence) -> KVHandoff:
        # The prompt's KV stays in the pool under a lease; the first token is not yet computed.
        self.scheduler.remove(seq)
        lease = self.leases.grant(seq.block_table, seq.num_computed_tokens)
        handoff = KVHandoff(lease.lease_id, lease.block_ids, lease.num_tokens, tuple(seq.block_hashes),
                            num_parted_blocks=seq.num_parted_blocks)
        seq.block_table, seq.block_hashes = [], []
        self.scheduler.finish(seq, "handoff")
        return handoff
