"""Leases: KV blocks held for a handoff, released explicitly, by adoption, or on expiry."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Lease:
    lease_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    expires_at: float


class LeaseTable:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self.leases)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held: a KV part's lease and its request's final lease share blocks."""
        return len({b for lease in self.leases.values() for b in lease.block_ids})

    def grant(self, block_ids: list[int], num_tokens: int, now: float | None = None) -> Lease:
        now = time.monotonic() if now is None else now
        lease = Lease(uuid.uuid4().hex, tuple(block_ids), num_tokens, now + self.ttl_s)
        self.leases[lease.lease_id] = lease
        return lease

    def renew(self, lease_id: str, now: float | None = None) -> bool:
        """Push a held lease's expiry a whole TTL past `now`; False if it is gone."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return False
        now = time.monotonic() if now is None else now
        self.leases[lease_id] = Lease(lease.lease_id, lease.block_ids, lease.num_tokens, now + self.ttl_s)
        return True

    def take(self, lease_id: str) -> Lease:
        """Remove and return a lease; the caller now owns its block references."""
        try:
            return self.leases.pop(lease_id)
        except KeyError:
            raise KeyError(f"unknown or expired lease {lease_id!r}") from None

    def oldest_age_s(self, now: float | None = None) -> float:
        """Seconds since the oldest lease still held was granted; 0 with none."""
        if not self.leases:
            return 0.0
        now = time.monotonic() if now is None else now
        return max(0.0, now - min(lease.expires_at for lease in self.leases.values()) + self.ttl_s)

    def expired(self, now: float | None = None) -> list[Lease]:
        now = time.monotonic() if now is None else now
        gone = [lease for lease in self.leases.values() if lease.expires_at <= now]
        for lease in gone:
            del self.leases[lease.lease_id]
        return gone
