"""Importing side of the shared-memory transport: bounded connection pools per exporter, each
connection with the staging memory its exporter passed, and the pull of one handoff over one."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from concurrent.futures import ThreadPoolExecutor

import torch
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports import shm_io
from pdserve.kvcache.transports.base import KVTransferError
from pdserve.kvcache.transports.shm_io import (
    ACK,
    DIRECT,
    FREE,
    HELLO,
    MAX_DETAIL,
    OK,
    READY,
    REQUEST,
    STATUS,
    VERSION,
    ShmConfig,
)

_MAX_SLOTS = 64
_DIRECT_PIECE = 4 << 20  # bytes per direct-read system call, dealt round-robin to the threads


class ShmUnreachable(KVTransferError):
    """The exporter could not be reached through shared memory; nothing was asked of it."""


class _Refused(KVTransferError):
    """The exporter refused the pull; the connection stays clean."""


class _Connection:
    def __init__(self, sock: socket.socket, staging: shm_io.Staging, slot_nbytes: int, num_slots: int) -> None:
        self.sock, self.staging, self.slot_nbytes, self.num_slots = sock, staging, slot_nbytes, num_slots
        self.direct: tuple[int, int, int] | None = None  # (exporter pid, pool address, pool bytes) to read directly

    def close(self) -> None:
        self.sock.close()
        self.staging.close()


class _Peer:
    def __init__(self, limit: int) -> None:
        self.slots = asyncio.Semaphore(limit)
        self.idle: list[_Connection] = []
        self.num_pulls = 0  # waiting for a slot or pulling


class ShmClient:
    def __init__(self, pool: KVPoolIO, config: ShmConfig) -> None:
        self.pool, self.config = pool, config
        self._peers: dict[str, _Peer] = {}
        self._closed = False
        self.num_connections_opened = 0
        self.num_pieces_received = 0
        self.num_direct_pulls = 0  # one kernel copy, pool to pool
        self.num_staged_pulls = 0  # two copies, through the staging slots
        self._readers: ThreadPoolExecutor | None = None

    @property
    def num_idle_connections(self) -> int:
        return sum(len(p.idle) for p in self._peers.values())

    async def pull(self, address: str, request: bytes, src_block_ids: tuple[int, ...], dest_block_ids: list[int]) -> None:
        if self._closed:
            raise KVTransferError("shared-memory transport is closed")
        peer = self._peers.setdefault(address, _Peer(self.config.max_connections))
        peer.num_pulls += 1
        try:
            await self._pull_from(peer, address, request, src_block_ids, dest_block_ids)
        finally:
            peer.num_pulls -= 1
            if not peer.num_pulls and not peer.idle:  # exporters come and go (replica restarts): forget this one
                self._peers.pop(address, None)

    async def _pull_from(self, peer: _Peer, address: str, request: bytes, src_block_ids: tuple[int, ...],
                         dest_block_ids: list[int]) -> None:
        try:
            await asyncio.wait_for(peer.slots.acquire(), self.config.timeout_s)
        except TimeoutError:
            raise KVTransferError(f"no free shared-memory connection to {address}") from None
        conn: _Connection | None = None
        is_clean = False
        try:
            conn = self._take_idle(peer) or await self._connect(address)
            try:
                await self._exchange(conn, request, src_block_ids, dest_block_ids)
            except _Refused:
                is_clean = True
                raise
            is_clean = True
        except ConnectionError as e:
            raise KVTransferError(f"shared-memory exporter {address} went away mid-pull: {e}") from e
        except (OSError, TimeoutError) as e:
            raise KVTransferError(f"shared-memory pull from {address} failed: {type(e).__name__}: {e}") from e
        finally:
            if conn is not None:
                if is_clean and not self._closed:
                    self._put_idle(peer, conn)
                else:
                    conn.close()  # mid-protocol: not reusable (and its staging unmapped)
            peer.slots.release()

    async def _connect(self, address: str) -> _Connection:
        timeout = self.config.timeout_s
        sock = shm_io.seqpacket_socket()
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, "\0" + address), timeout)
            if shm_io.peer_uid(sock) != os.getuid():
                raise ShmUnreachable(f"{address} belongs to another user")
            hello, fd = await shm_io.recv_with_fd(sock, HELLO.size, timeout)
            if fd is None:
                raise ShmUnreachable(f"{address} closed the connection (at its connection limit?)")
            try:
                fields = HELLO.unpack(hello) if len(hello) == HELLO.size else (b"", 0, 0, 0, 0, 0, 0)
                magic, version, _, slot_nbytes, num_slots, pool_address, pool_nbytes = fields
                if magic != b"PDSH" or version != VERSION:
                    raise ShmUnreachable(f"{address} is not a pdserve shared-memory exporter")
                if slot_nbytes <= 0 or slot_nbytes % self.pool.block_nbytes or not 0 < num_slots <= _MAX_SLOTS:
                    raise ShmUnreachable(f"{address} offers slots of {slot_nbytes} bytes; ours are blocks of "
                                         f"{self.pool.block_nbytes}")
                staging = shm_io.Staging.adopt(fd, slot_nbytes * num_slots)
            finally:
                os.close(fd)
        except ShmUnreachable:
            sock.close()
            raise
        except (OSError, TimeoutError, KVTransferError) as e:
            sock.close()
            raise ShmUnreachable(f"cannot reach {address}: {type(e).__name__}: {e}") from e
        self.num_connections_opened += 1
        conn = _Connection(sock, staging, slot_nbytes, num_slots)
        pid = shm_io.peer_pid(sock)
        if self.config.direct_read and self.pool.is_host and pool_address and pid and shm_io.can_read_peer(pid, pool_address):
            conn.direct = (pid, pool_address, pool_nbytes)
        return conn

    async def _exchange(self, conn: _Connection, request: bytes, src_block_ids: tuple[int, ...],
                        dest_block_ids: list[int]) -> None:
        loop = asyncio.get_running_loop()
        flags = DIRECT if conn.direct is not None else 0
        await loop.sock_sendall(conn.sock, request[:6] + struct.pack("<H", flags) + request[8 : REQUEST.size])
        status_message = await self._recv(conn, STATUS.size + MAX_DETAIL, "the status")
        if len(status_message) < STATUS.size:
            raise KVTransferError("malformed status from the exporter")
        magic, version, status, detail_nbytes = STATUS.unpack_from(status_message)
        if magic != b"PDSS" or version != VERSION:
            raise KVTransferError(f"unexpected message {magic!r} from the exporter")
        if status != OK:
            detail = status_message[STATUS.size : STATUS.size + detail_nbytes].decode(errors="replace")
            raise _Refused(f"shared-memory exporter refused the pull (status {status}): {detail}")
        if conn.direct is not None:
            await self._read_directly(conn, src_block_ids, dest_block_ids)
            self.num_direct_pulls += 1
            await loop.sock_sendall(conn.sock, ACK.pack(b"PDSA", VERSION, 0))
            return
        per_slot = conn.slot_nbytes // self.pool.block_nbytes
        for piece, first in enumerate(range(0, len(dest_block_ids), per_slot)):
            ready = await self._recv(conn, READY.size, "KV blocks")
            count = min(per_slot, len(dest_block_ids) - first)
            slot = piece % conn.num_slots
            if len(ready) != READY.size or READY.unpack(ready) != (b"PDSR", VERSION, 0, slot, first, count):
                raise KVTransferError(f"exporter announced other blocks than piece {piece} (blocks {first}+{count})")
            shm_io.scatter(self.pool, dest_block_ids[first : first + count], conn.staging.slot(slot, conn.slot_nbytes))
            self.num_pieces_received += 1
            await loop.sock_sendall(conn.sock, FREE.pack(b"PDSF", VERSION, 0, slot))
        self.num_staged_pulls += 1
        await loop.sock_sendall(conn.sock, ACK.pack(b"PDSA", VERSION, 0))

    async def _read_directly(self, conn: _Connection, src_block_ids: tuple[int, ...], dest_block_ids: list[int]) -> None:
        """Copies the blocks out of the exporter's pool, which holds them under the lease until our ACK, with
        as many threads as torch may use here (the kernel copy runs on the calling thread)."""
        assert conn.direct is not None
        pid, base, nbytes = conn.direct
        if any(not 0 <= b < nbytes // self.pool.block_nbytes for b in src_block_ids):
            raise KVTransferError("handoff names blocks outside the exporter's pool")
        pieces = [(dst + k, src + k, min(_DIRECT_PIECE, length - k))
                  for dst, src, length in shm_io.direct_spans(self.pool, base, src_block_ids, dest_block_ids)
                  for k in range(0, length, _DIRECT_PIECE)]
        num_threads = max(1, torch.get_num_threads())
        if self._readers is None:
            self._readers = ThreadPoolExecutor(num_threads, thread_name_prefix="pdkv-read")
        loop = asyncio.get_running_loop()
        reads = asyncio.gather(*[loop.run_in_executor(self._readers, shm_io.read_peer, pid, pieces[i::num_threads])
                                 for i in range(min(num_threads, len(pieces)))])
        is_cancelled = False
        while not reads.done():  # a read still running writes into the destination: never return before it ends
            try:
                await asyncio.shield(reads)
            except asyncio.CancelledError:
                is_cancelled = True
        if is_cancelled:
            if not reads.cancelled():
                reads.exception()  # retrieved: the caller sees its cancellation
            raise asyncio.CancelledError
        reads.result()

    async def _recv(self, conn: _Connection, nbytes: int, what: str) -> bytes:
        try:
            data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(conn.sock, nbytes), self.config.timeout_s)
        except TimeoutError:
            raise KVTransferError(f"shared-memory exporter sent no {what} in {self.config.timeout_s:g}s") from None
        except ConnectionError as e:
            raise KVTransferError(f"shared-memory exporter went away before sending {what}: {e}") from e
        if not data:
            raise KVTransferError(f"shared-memory exporter went away before sending {what}")
        return data

    def _take_idle(self, peer: _Peer) -> _Connection | None:
        if not peer.idle:
            return None
        conn = peer.idle.pop()
        asyncio.get_running_loop().remove_reader(conn.sock.fileno())
        return conn

    def _put_idle(self, peer: _Peer, conn: _Connection) -> None:
        peer.idle.append(conn)
        # an idle connection is readable only when its exporter closed it (or died): drop it at once,
        # unmapping its staging memory
        asyncio.get_running_loop().add_reader(conn.sock.fileno(), self._drop_idle, peer, conn)

    def _drop_idle(self, peer: _Peer, conn: _Connection) -> None:
        asyncio.get_running_loop().remove_reader(conn.sock.fileno())
        if conn in peer.idle:
            peer.idle.remove(conn)
        conn.close()
        if not peer.num_pulls and not peer.idle:
            self._peers = {a: p for a, p in self._peers.items() if p is not peer}

    def close(self) -> None:
        self._closed = True
        if self._readers is not None:
            self._readers.shutdown(wait=False)
        for peer in self._peers.values():
            while peer.idle:
                self._drop_idle(peer, peer.idle[-1])

