"""Shared-memory transport: on one node the decode side pulls a lease's blocks from the prefill process
without a network stack. Direct lane: the importer copies them straight out of the exporter's pool
(process_vm_readv: one kernel copy) where the kernel lets it read that process. Staged lane, elsewhere:
through staging memory both processes map, one copy on each side (pool -> slot -> pool).

The exporter listens on an abstract Unix SEQPACKET socket (a random name: no file to leave behind) and
accepts only peers of its own user (SO_PEERCRED). Each connection gets its own staging memory, a sealed
memfd of `num_slots` slots, passed once with HELLO; staged handoffs on that connection reuse it.

    exporter -> HELLO    <4s H H I I Q Q> b"PDSH", version, flags 0, slot bytes, num slots, pool address and
                         bytes (0: no direct reads); the memfd (SCM_RIGHTS)
    importer -> REQUEST  <4s H H 32s 32s Q Q I I> b"PDSQ", version, flags (DIRECT), lease id and handoff secret
                         (hex ascii), layout hash, handoff digest (block ids and hashes), block bytes, num blocks
    exporter -> STATUS   <4s H H I> b"PDSS", version, status, then a UTF-8 reason (status not OK)
    DIRECT: the importer copies the blocks out of the exporter's pool (process_vm_readv), then ACK. Else:
    exporter -> READY    <4s H H I I I> b"PDSR", version, 0, slot, first handoff index, num blocks: the slot
                         holds those blocks
    importer -> FREE     <4s H H I> b"PDSF", version, 0, slot: copied out, the exporter may refill it
    importer -> ACK      <4s H H> b"PDSA", version, 0: every block landed; the exporter releases the lease

With several slots the exporter fills one while the importer empties another. A lease is served only to a
request carrying the handoff's secret (constant-time compare); a wrong one gets the same refusal as an
unknown lease, before any block is copied. A peer that dies mid-transfer shows as EOF on the socket: the
importer raises KVTransferError (its caller discards the reserved blocks), the exporter keeps the export
for a retry until it is forgotten or its lease expires, and the staging memory goes with the last mapping.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import re
import secrets
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

from pdserve.kvcache.layout import KVLayout, LayoutMismatch
from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports import shm_io
from pdserve.kvcache.transports.base import KVTransferError, KVTransport, ReleaseFn
from pdserve.kvcache.transports.shm_client import ShmClient, ShmUnreachable
from pdserve.kvcache.transports.shm_io import (
    ACK,
    BAD_REQUEST,
    DIRECT,
    FREE,
    HELLO,
    MAX_DETAIL,
    OK,
    READY,
    REQUEST,
    STATUS,
    UNKNOWN_LEASE,
    VERSION,
    ShmConfig,
)

__all__ = ["ShmConfig", "ShmTransport", "ShmUnreachable"]

logger = logging.getLogger(__name__)

LEASE_ID = re.compile(r"[0-9a-f]{32}")
ADDRESS = re.compile(r"pdserve-kv-[0-9a-f]{32}")
_NO_SECRET = bytes(32)


@dataclass(frozen=True)
class _Export:
    block_ids: tuple[int, ...]
    digest: int  # handoff_digest of the params handed out
    secret: bytes


class ShmTransport(KVTransport):
    """Point-to-point pull between processes of one node (`shm_io.node_id`), directly or staged (see above).

    `on_claim(lease_id)`, when given, is asked before a lease is served; False refuses the pull (a
    composite transport uses it to withdraw the lease from its other path first).
    """

    name: ClassVar[str] = "shm"

    def __init__(
        self, pool: KVPoolIO, layout: KVLayout, release: ReleaseFn | None = None, *,
        config: ShmConfig | None = None, on_claim: Callable[[str], bool] | None = None,
    ) -> None:
        super().__init__(pool, layout, release)
        if layout.block_nbytes != pool.block_nbytes:
            raise LayoutMismatch(f"layout blocks are {layout.block_nbytes} bytes, pool blocks {pool.block_nbytes}")
        self.config = config or ShmConfig()
        self.on_claim = on_claim
        self.node_id = shm_io.node_id()
        self.address = f"pdserve-kv-{secrets.token_hex(16)}"
        self.client = ShmClient(pool, self.config)
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._handlers: set[asyncio.Task] = set()
        self._exports: dict[str, _Export] = {}
        self._serving: dict[str, _Export] = {}
        self.num_refused_pulls = 0
        self.num_pieces_sent = 0

    @property
    def _direct_window(self) -> tuple[int, int]:
        """(address, bytes) of the pool that importers may read directly; (0, 0): none."""
        if not self.config.direct_read or not self.pool.is_host:
            return 0, 0
        return self.pool.kv_pool.data_ptr(), self.pool.num_blocks * self.pool.block_nbytes

    @property
    def is_available(self) -> bool:
        return self.node_id is not None

    def is_local(self, params: HandoffParams) -> bool:
        """Whether `params` name an exporter this process can reach through shared memory."""
        return self.is_available and params.node_id == self.node_id and params.local_address is not None

    # ---- exporting side ----

    async def start(self) -> None:
        if self._listener is None:
            sock = shm_io.seqpacket_socket()
            sock.bind("\0" + self.address)
            sock.listen(64)
            self._listener = sock
            self._accepting = asyncio.get_running_loop().create_task(self._accept())

    async def export(self, lease_id: str, block_ids: list[int], block_hashes: list[int], num_tokens: int) -> HandoffParams:
        params = HandoffParams(self.name, self.layout.layout_hash, lease_id, num_tokens, tuple(block_ids),
                               tuple(block_hashes), secret=secrets.token_hex(16))
        return self.share(params)

    def share(self, params: HandoffParams) -> HandoffParams:
        """Serves the lease of `params` (blocks, hashes, secret) here too; returns them with this node's
        id and address, so that an importer on this node can pull through shared memory."""
        if self._listener is None:
            raise RuntimeError("start() the shared-memory transport before exporting")
        if not LEASE_ID.fullmatch(params.lease_id):
            raise ValueError(f"lease id {params.lease_id!r} is not 32 lowercase hex digits")
        if params.lease_id in self._exports or params.lease_id in self._serving:
            raise ValueError(f"lease {params.lease_id} is already exported")
        for b in params.block_ids:
            self.pool.block_tensor(b)  # IndexError at export, not at the pull
        digest = shm_io.handoff_digest(params.block_ids, params.block_hashes)
        self._exports[params.lease_id] = _Export(params.block_ids, digest, params.secret.encode("ascii"))
        return replace(params, node_id=self.node_id, local_address=self.address)

    def forget(self, lease_id: str) -> bool:
        return (self._exports.pop(lease_id, None) or self._serving.pop(lease_id, None)) is not None

    def exported_lease_ids(self) -> list[str]:
        return [*self._exports, *self._serving]

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            if len(self._handlers) >= self.config.max_served_connections or shm_io.peer_uid(conn) != os.getuid():
                conn.close()  # the importer sees EOF before HELLO: unreachable, it takes its other path
                continue
            task = loop.create_task(self._serve(conn))
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)

    async def _serve(self, conn: socket.socket) -> None:
        slot_nbytes = self.config.slot_blocks(self.pool.block_nbytes) * self.pool.block_nbytes
        staging: shm_io.Staging | None = None
        try:
            staging, fd = shm_io.Staging.create(slot_nbytes * self.config.num_slots)
            hello = HELLO.pack(b"PDSH", VERSION, 0, slot_nbytes, self.config.num_slots, *self._direct_window)
            try:
                socket.send_fds(conn, [hello], [fd])
            finally:
                os.close(fd)  # the mapping (and the importer's) keep the memory
            loop = asyncio.get_running_loop()
            while True:
                request = await loop.sock_recv(conn, REQUEST.size + 1)  # idle until the next pull
                if not request:
                    return  # the importer closed the connection
                await self._serve_one(conn, staging, slot_nbytes, request)
        except (KVTransferError, OSError, TimeoutError) as e:
            logger.debug("shared-memory export connection dropped: %s", e)
        except Exception:
            logger.exception("shared-memory export connection failed")
        finally:
            conn.close()
            if staging is not None:
                staging.close()

    async def _serve_one(self, conn: socket.socket, staging: shm_io.Staging, slot_nbytes: int, request: bytes) -> None:
        if len(request) != REQUEST.size:
            raise KVTransferError(f"short pull request ({len(request)} bytes)")
        magic, version, flags, raw_lease, secret, layout_hash, digest, block_nbytes, num_blocks = REQUEST.unpack(request)
        if magic != b"PDSQ" or version != VERSION or flags & ~DIRECT or (flags & DIRECT and not self._direct_window[0]):
            raise KVTransferError(f"bad pull request (magic {magic!r}, version {version})")
        lease_id = raw_lease.decode("ascii", "replace")
        export = self._exports.get(lease_id)
        # one answer for unknown, busy and wrong secret: a peer learns nothing about leases it was not handed
        is_handed = hmac.compare_digest(secret, export.secret if export is not None else _NO_SECRET)
        if export is None or not is_handed:
            self.num_refused_pulls += 1
            return await self._send_status(conn, UNKNOWN_LEASE, f"unknown, expired or busy lease {lease_id}")
        if (layout_hash, block_nbytes, num_blocks, digest) != (
                self.layout.layout_hash, self.pool.block_nbytes, len(export.block_ids), export.digest):
            return await self._send_status(conn, BAD_REQUEST, f"lease {lease_id} holds other blocks, or another layout")
        if self.on_claim is not None and not self.on_claim(lease_id):
            return await self._send_status(conn, UNKNOWN_LEASE, f"lease {lease_id} is being served elsewhere")
        del self._exports[lease_id]
        self._serving[lease_id] = export
        is_acked = False
        try:
            await self._send_status(conn, OK, "")
            if not flags & DIRECT:  # else the importer is reading the blocks out of the pool meanwhile
                staging.reserve()
                await self._send_blocks(conn, staging, slot_nbytes, export.block_ids)
            is_acked = await self._recv(conn, ACK, b"PDSA") is not None
        finally:
            if self._serving.pop(lease_id, None) is not None:  # not forgotten meanwhile
                if not is_acked:
                    self._exports[lease_id] = export  # the importer may retry; expiry or forget() drops it
                else:
                    self.release_soon(lease_id)  # this connection serves its next pull at once

    async def _send_blocks(self, conn: socket.socket, staging: shm_io.Staging, slot_nbytes: int,
                           block_ids: tuple[int, ...]) -> None:
        loop = asyncio.get_running_loop()
        per_slot = slot_nbytes // self.pool.block_nbytes
        num_busy = 0  # slots filled and not yet freed; they free in fill order
        for piece, first in enumerate(range(0, len(block_ids), per_slot)):
            slot = piece % self.config.num_slots
            if num_busy == self.config.num_slots:
                freed = await self._recv(conn, FREE, b"PDSF")
                if freed is None or freed[3] != slot:
                    raise KVTransferError("importer freed slots out of order")
                num_busy -= 1
            ids = block_ids[first : first + per_slot]
            shm_io.gather(self.pool, ids, staging.slot(slot, slot_nbytes))
            await loop.sock_sendall(conn, READY.pack(b"PDSR", VERSION, 0, slot, first, len(ids)))
            num_busy += 1
            self.num_pieces_sent += 1
        for _ in range(num_busy):
            if await self._recv(conn, FREE, b"PDSF") is None:
                raise KVTransferError("importer left before freeing its slots")

    async def _send_status(self, conn: socket.socket, status: int, reason: str) -> None:
        detail = reason.encode()[:MAX_DETAIL]
        await asyncio.get_running_loop().sock_sendall(conn, STATUS.pack(b"PDSS", VERSION, status, len(detail)) + detail)

    async def _recv(self, conn: socket.socket, kind: struct.Struct, magic: bytes) -> tuple | None:
        """The next message, which must be of `kind`; None when the peer closed the connection."""
        # one byte more than the message: a longer one shows as such instead of being cut to size
        data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(conn, kind.size + 1), self.config.timeout_s)
        if not data:
            return None
        fields = kind.unpack(data) if len(data) == kind.size else (b"", 0)
        if fields[0] != magic or fields[1] != VERSION:
            raise KVTransferError(f"unexpected message from the importer ({len(data)} bytes, expected {magic!r})")
        return fields

    # ---- importing side ----

    async def pull(self, params: HandoffParams, dest_block_ids: list[int]) -> None:
        """Raises ShmUnreachable (nothing was asked of the exporter) when the exporter cannot be reached."""
        self._check_pull(params, dest_block_ids)
        if not self.is_local(params):
            raise ShmUnreachable(f"lease {params.lease_id} was not exported on this node")
        if not LEASE_ID.fullmatch(params.lease_id) or not ADDRESS.fullmatch(params.local_address or ""):
            raise ValueError(f"malformed lease id or shared-memory address in {params}")
        if len(params.secret) > 32 or not params.secret.isascii():
            raise ValueError("a handoff secret is at most 32 ascii characters")
        if len(set(dest_block_ids)) != len(dest_block_ids):
            raise ValueError(f"duplicate destination blocks {dest_block_ids}")
        for b in dest_block_ids:
            self.pool.block_tensor(b)  # IndexError before any I/O
        request = REQUEST.pack(b"PDSQ", VERSION, 0, params.lease_id.encode("ascii"), params.secret.encode("ascii"),
                               params.layout_hash, shm_io.handoff_digest(params.block_ids, params.block_hashes),
                               self.pool.block_nbytes, len(dest_block_ids))
        await self.client.pull(params.local_address, request, params.block_ids, dest_block_ids)
        self.bytes_pulled += len(dest_block_ids) * self.pool.block_nbytes

    async def close(self) -> None:
        self.client.close()
        if self._accepting is not None:
            self._accepting.cancel()
            await asyncio.gather(self._accepting, return_exceptions=True)
            self._accepting = None
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self.settle_releases()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._exports.clear()
        self._serving.clear()
