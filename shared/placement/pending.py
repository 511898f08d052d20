"""What the router placed on each replica that the replica's last stats may not show yet.

A placement counts as pending on a replica until stats taken at least `grace_s` after it arrive (the
request has reached the engine by then), until the router sees its request end (`done`: a request shorter
than the poll period would otherwise count as load after it finished), or until `max_age_s` passes.
Torch-free and Ray-free: the router owns one and calls it from its event loop.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from pdserve.placement.policy import Placement, PlacementRequest, ReplicaSnapshot


def placement_entries(placement: Placement, request: PlacementRequest, block_size: int) -> list[tuple[str, int, int]]:
    prompt = request.num_prompt_tokens
    computed = prompt - placement.prefix_hit_tokens
    entries = []
    if placement.disaggregate and placement.prefill_replica is not None:
        entries.append((placement.prefill_replica, computed, -(-prompt // block_size)))
    if placement.decode_replica is not None:
        local_prefill = 0 if placement.disaggregate else computed
        entries.append((placement.decode_replica, local_prefill, -(-(prompt + request.max_tokens) // block_size)))
    return entries


@dataclass(frozen=True)
class _Entry:
    placed_at: float
    prefill_tokens: int
    blocks: int
    key: Hashable = None  # the request's, for `done`; None: another router's placement


class PendingPlacements:
    def __init__(self, grace_s: float = 0.05, max_age_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s = grace_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._entries: dict[str, list[_Entry]] = defaultdict(list)

    def record(self, replica_id: str, prefill_tokens: int, blocks: int, placed_at: float | None = None,
               key: Hashable = None) -> None:
        """`placed_at` (this object's clock): when another router placed it; None: now."""
        placed_at = self._clock() if placed_at is None else placed_at
        self._entries[replica_id].append(_Entry(placed_at, prefill_tokens, blocks, key))

    def record_placement(self, placement: Placement, request: PlacementRequest,
                         block_size: int, key: Hashable = None) -> list[tuple[str, int, int]]:
        """Records, and returns as (replica, prefill tokens, blocks), the prompt's prefill (less its expected
        prefix hit) and blocks on the prefill replica (or the decode replica when local), and the whole
        sequence's blocks on the decode replica. `key` names the request for `done`."""
        entries = placement_entries(placement, request, block_size)
        for replica_id, prefill_tokens, blocks in entries:
            self.record(replica_id, prefill_tokens, blocks, key=key)
        return entries

    def done(self, key: Hashable) -> None:
        """The request recorded under `key` ended: it no longer loads any replica, whatever stats show yet."""
        if key is None:
            return
        for replica_id, entries in self._entries.items():
            if any(e.key == key for e in entries):
                self._entries[replica_id] = [e for e in entries if e.key != key]

    def observe(self, replica_id: str, stats_taken_at: float) -> None:
        """Stats taken at `stats_taken_at` (this object's clock) show every placement up to grace_s before."""
        if entries := self._entries.get(replica_id):
            horizon = stats_taken_at - self.grace_s
            self._entries[replica_id] = [e for e in entries if e.placed_at > horizon]

    def apply(self, snapshot: ReplicaSnapshot) -> ReplicaSnapshot:
        entries = self._entries.get(snapshot.replica_id)
        if not entries:  # most replicas, most of the time: the snapshot as it is (it carries no pending)
            return snapshot
        oldest = self._clock() - self.max_age_s
        entries = self._entries[snapshot.replica_id] = [e for e in entries if e.placed_at > oldest]
        return dataclasses.replace(
            snapshot, num_pending=len(entries), pending_prefill_tokens=sum(e.prefill_tokens for e in entries),
            pending_blocks=sum(e.blocks for e in entries),
        )
