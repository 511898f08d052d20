"""The router's view of what each replica's KV pool holds: chained block hashes per replica, kept from the
replicas' KV events (pdserve.kv_events), with a staleness bound.

- A replica's entry is fresh while its last successful read is at most `max_age_s` old; past that its
  pool is unknown (None: no prefix credit) until a read succeeds again.
- A reset batch (first read, a restarted pool, a cursor the worker no longer has) replaces the entry
  with the full set the worker sent; an ordinary batch applies its stored/evicted events in order.
- Blocks the router just placed on a replica count as held there for `expect_s` (the request's
  prefill will store them), so a burst sharing a new prefix follows the first request; an event for
  the hash settles it either way.
Torch-free and Ray-free: the router owns one and feeds it from its stats poller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field

from pdserve.kv_events import STORED, KVEventBatch


@dataclass
class _Entry:
    epoch: str
    seq: int
    hashes: set[int]
    read_at: float
    layout_hash: int | None = None
    expected: dict[int, float] = field(default_factory=dict)  # hash -> when the expectation lapses


class _HeldView(Container[int]):
    """Membership in a replica's pool as the router knows it: reported, or expected from a placement."""

    __slots__ = ("_entry", "_now")

    def __init__(self, entry: _Entry, now: float) -> None:
        self._entry, self._now = entry, now

    def __contains__(self, block_hash: object) -> bool:
        if block_hash in self._entry.hashes:
            return True
        lapses = self._entry.expected.get(block_hash)  # type: ignore[call-overload]
        return lapses is not None and lapses > self._now


class PrefixIndex:
    def __init__(self, max_age_s: float = 1.0, expect_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_age_s <= 0 or expect_s < 0:
            raise ValueError("max_age_s must be positive and expect_s non-negative")
        self.max_age_s = max_age_s
        self.expect_s = expect_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}

    def cursor(self, replica: str) -> tuple[str, int] | None:
        """What to send the replica with the next read: the last batch applied, or None for a full set."""
        entry = self._entries.get(replica)
        return None if entry is None else (entry.epoch, entry.seq)

    def apply(self, replica: str, batch: KVEventBatch, layout_hash: int | None = None) -> None:
        now = self._clock()
        entry = self._entries.get(replica)
        if batch.reset:
            expected = entry.expected if entry is not None else {}
            entry = self._entries[replica] = _Entry(batch.epoch, batch.seq, set(batch.hashes), now, expected=expected)
        elif entry is None or entry.epoch != batch.epoch:
            self._entries.pop(replica, None)  # a batch for a cursor we never gave: read everything next time
            return
        else:
            for op, h in batch.events:
                if op == STORED:
                    entry.hashes.add(h)
                else:
                    entry.hashes.discard(h)
                entry.expected.pop(h, None)
            entry.seq, entry.read_at = batch.seq, now
        if layout_hash is not None:
            entry.layout_hash = layout_hash
        for h in [h for h, lapses in entry.expected.items() if lapses <= now]:
            del entry.expected[h]

    def expect(self, replica: str, block_hashes: Sequence[int]) -> None:
        """The replica was just given a prompt with these block hashes."""
        entry = self._entries.get(replica)
        if entry is None or not self.expect_s:
            return
        lapses = self._clock() + self.expect_s
        for h in block_hashes:
            if h not in entry.hashes:
                entry.expected[h] = lapses

    def forget(self, replica: str) -> None:
        self._entries.pop(replica, None)

    def is_fresh(self, replica: str) -> bool:
        entry = self._entries.get(replica)
        return entry is not None and self._clock() - entry.read_at <= self.max_age_s

    def held(self, replica: str) -> Container[int] | None:
        """The replica's pool as a container of block hashes; None when unknown or stale. A view: valid
        until the next `apply`, so read it within one placement."""
        entry = self._entries.get(replica)
        now = self._clock()
        if entry is None or now - entry.read_at > self.max_age_s:
            return None
        return _HeldView(entry, now)

    def match(self, replica: str, block_hashes: Sequence[int]) -> int:
        """Leading blocks of the chain the replica holds (0 when unknown or stale)."""
        held = self.held(replica)
        return 0 if held is None else leading_hits(block_hashes, held)

    def layout_hash(self) -> int | None:
        """The KV layout hash fresh replicas report (the key space of the Redis tier)."""
        for replica, entry in self._entries.items():
            if entry.layout_hash is not None and self.is_fresh(replica):
                return entry.layout_hash
        return None


def leading_hits(block_hashes: Sequence[int], held: Container[int] | None) -> int:
    """Leading blocks of a hash chain in `held`: chained hashes, so the first miss ends the shared prefix."""
    if held is None:
        return 0
    hits = 0
    for h in block_hashes:
        if h not in held:
            break
        hits += 1
    return hits
