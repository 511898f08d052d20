"""KV events: which chained block hashes a worker's pool holds, as a log a router reads with a cursor.

The block manager reports every hash that enters its prefix cache (`stored`) or leaves it (`evicted`,
when its block is reused). A reader keeps `(epoch, seq)`; `read(cursor)` returns the events after it,
or the whole set held (`reset`) when the cursor is from another epoch (a restarted pool) or older
than the log keeps. Thread-safe: the engine's step thread writes, the replica's event loop reads.
Torch-free, so the router imports it.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

STORED, EVICTED = 1, 0


@dataclass(frozen=True)
class KVEventBatch:
    """Wire form (plain data): the events after the reader's cursor, or the full set when `reset`."""

    epoch: str
    seq: int  # the cursor after applying this batch
    reset: bool
    events: tuple[tuple[int, int], ...] = ()  # (STORED | EVICTED, block hash), in order
    hashes: tuple[int, ...] = ()  # every hash held, when reset

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seq": self.seq, "reset": self.reset, "events": list(self.events),
                "hashes": list(self.hashes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVEventBatch:
        events = tuple((int(op), int(h)) for op, h in data.get("events", ()))
        if any(op not in (STORED, EVICTED) for op, _ in events):
            raise ValueError("unknown KV event kind")
        return cls(str(data["epoch"]), int(data["seq"]), bool(data["reset"]), events,
                   tuple(int(h) for h in data.get("hashes", ())))


class KVEventLog:
    def __init__(self, capacity: int = 8192) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self.epoch = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._events: deque[tuple[int, int]] = deque(maxlen=capacity)
        self._seq = 0  # events ever logged; the last one has this number
        self._held: set[int] = set()

    def stored(self, block_hash: int) -> None:
        with self._lock:
            self._held.add(block_hash)
            self._append(STORED, block_hash)

    def evicted(self, block_hash: int) -> None:
        with self._lock:
            self._held.discard(block_hash)
            self._append(EVICTED, block_hash)

    def _append(self, op: int, block_hash: int) -> None:
        self._events.append((op, block_hash))
        self._seq += 1

    def num_leading_held(self, block_hashes: Iterable[int]) -> int:
        """How many leading hashes of a chain the pool holds now."""
        count = 0
        with self._lock:
            for h in block_hashes:
                if h not in self._held:
                    break
                count += 1
        return count

    def read(self, cursor: Sequence[Any] | None = None) -> KVEventBatch:
        """Events after `cursor` ((epoch, seq) of the reader's last batch), or a reset batch."""
        with self._lock:
            oldest = self._seq - len(self._events)  # the first kept event has number oldest + 1
            seen = _cursor_seq(cursor, self.epoch)
            if seen is None or not oldest <= seen <= self._seq:
                return KVEventBatch(self.epoch, self._seq, True, hashes=tuple(self._held))
            return KVEventBatch(self.epoch, self._seq, False, tuple(itertools.islice(self._events, seen - oldest, None)))


def _cursor_seq(cursor: Sequence[Any] | None, epoch: str) -> int | None:
    """The cursor's sequence number when it is one of this log's; None otherwise."""
    if cursor is None or len(cursor) != 2 or cursor[0] != epoch:
        return None
    try:
        return int(cursor[1])
    except (TypeError, ValueError):
        return None
