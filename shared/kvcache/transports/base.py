"""KV transport contract. One instance per worker, bound to that worker's pool and layout."""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import ClassVar

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.pool import KVPoolIO

# Called on the exporting side once a lease's blocks are no longer needed there.
ReleaseFn = Callable[[str], Awaitable[None]]

logger = logging.getLogger(__name__)


class KVTransferError(RuntimeError):
    """A transfer failed (peer gone, store down, timeout); the destination blocks must be discarded."""


class KVTransport(ABC):
    """Moves the KV blocks of one request from a prefill pool into a decode pool.

    Exporting side: `export(lease_id, block_ids, block_hashes, num_tokens)` makes the leased blocks
    available and returns HandoffParams; the transport calls `release(lease_id)` when the blocks
    may be freed (pulled and confirmed, or copied out to a store). Leases it never releases expire
    in the engine, and the owner then `forget`s them here (as it does an aborted request's). A
    transport that keeps exports serves each only to the holder of its HandoffParams (lease id and,
    where it has one, the per-handoff secret).

    Importing side: `pull(params, dest_block_ids)` fills the given blocks (reserved, not yet
    visible to any sequence) and verifies them before returning. On any error it raises
    (WireError, LayoutMismatch, KVTransferError) and the caller releases the reservation.
    """

    name: ClassVar[str]

    def __init__(self, pool: KVPoolIO, layout: KVLayout, release: ReleaseFn | None = None) -> None:
        self.pool = pool
        self.layout = layout
        self.release = release
        self.bytes_pulled = 0  # KV wire bytes (headers and blocks, scales included) this side received
        self._releasing: set[asyncio.Task] = set()

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Open listeners or connections."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Close listeners and connections."""

    @abstractmethod
    async def export(
        self, lease_id: str, block_ids: list[int], block_hashes: list[int], num_tokens: int
    ) -> HandoffParams: ...

    @abstractmethod
    async def pull(self, params: HandoffParams, dest_block_ids: list[int]) -> str | None:
        """Land the exported blocks in `dest_block_ids`; the name of the path the bytes took where this
        transport has several (same_host: "shm" or its remote's name), else None."""

    def release_soon(self, lease_id: str) -> None:
        """Release a served lease without holding up the caller. The engine frees a lease between steps, a
        whole prefill step away at worst (its lock is held for the step), and a connection that waited for
        that would hold the next pull on it, stalling that request's first decode step."""
        if self.release is None:
            return
        task = asyncio.get_running_loop().create_task(self._release_logged(lease_id))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def _release_logged(self, lease_id: str) -> None:
        try:
            await self.release(lease_id)  # type: ignore[misc]
        except Exception:
            logger.exception("release of lease %s failed", lease_id)

    async def settle_releases(self, timeout_s: float = 10.0) -> None:
        """Wait for the releases in flight (a transport closing); the engine expires what is left."""
        if self._releasing:
            await asyncio.wait(list(self._releasing), timeout=timeout_s)

    def forget(self, lease_id: str) -> bool:
        """Drop the export of `lease_id` (request aborted, lease expired): it can no longer be pulled.
        True if there was one. Transports that hold nothing once `export` returns (redis) have none."""
        return False

    def exported_lease_ids(self) -> list[str]:
        """Leases exported here and not yet pulled, released or forgotten."""
        return []

    @property
    def num_exports(self) -> int:
        return len(self.exported_lease_ids())

    def _check_pull(self, params: HandoffParams, dest_block_ids: list[int]) -> None:
        self.layout.check_compatible(params.layout_hash)
        if len(dest_block_ids) != len(params.block_ids):
            raise ValueError(f"{len(dest_block_ids)} destination blocks for {len(params.block_ids)} source blocks")
