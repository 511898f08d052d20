"""The shared-memory transport's plumbing: which processes count as one node, the staging memory two
peers share, block gathers and scatters between a pool and that memory, and SEQPACKET socket I/O.

Staging memory is a sealed memfd: it has no name in /dev/shm or anywhere else, reaches a peer only as a
file descriptor over the transport's socket (SCM_RIGHTS), and the kernel frees it with the last mapping
or descriptor, so a peer killed with SIGKILL leaves nothing behind. It is sealed against shrinking, so
a mapping of it can never fault (SIGBUS) on a truncated file.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import fcntl
import mmap
import os
import socket
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports.base import KVTransferError

# the wire protocol (see pdserve.kvcache.transports.shm)
VERSION = 1
HELLO = struct.Struct("<4sHHIIQQ")
REQUEST = struct.Struct("<4sHH32s32sQQII")
STATUS = struct.Struct("<4sHHI")
READY = struct.Struct("<4sHHIII")
FREE = struct.Struct("<4sHHI")
ACK = struct.Struct("<4sHH")
OK, UNKNOWN_LEASE, BAD_REQUEST = 0, 1, 2
DIRECT = 1  # REQUEST flag: the importer copies the blocks out of the exporter's pool itself
MAX_DETAIL = 1024

STAGING_NAME = "pdkv-staging"  # how the memfd shows in /proc/<pid>/maps: "/memfd:pdkv-staging (deleted)"
_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True)
class ShmConfig:
    # staging per slot (rounded down to whole blocks, at least one); each slot costs both processes a wakeup,
    # which on a busy 2-core machine outweighed the overlap that smaller slots give
    slot_bytes: int = 16 << 20
    num_slots: int = 2
    # one kernel copy from the exporter's pool into the importer's (process_vm_readv) where the kernel lets this
    # user read the exporter's memory; else, or off, through the staging slots (two copies)
    direct_read: bool = True
    max_connections: int = 4  # per exporter, from one importer
    max_served_connections: int = 16  # an exporter's connections from all importers (each maps its staging)
    timeout_s: float = 10.0  # every single wait on a peer mid-transfer

    def __post_init__(self) -> None:
        if self.slot_bytes < 1 or self.num_slots < 1 or self.max_connections < 1 or self.max_served_connections < 1:
            raise ValueError("slot_bytes, num_slots and the connection limits must be positive")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")

    def slot_blocks(self, block_nbytes: int) -> int:
        return max(1, self.slot_bytes // block_nbytes)


def node_id() -> str | None:
    """Who can reach this process's abstract socket and pass its peer check: one kernel boot, one network
    namespace, one user. None where /proc does not say (the shared-memory path is then never chosen)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        netns = os.stat("/proc/self/ns/net")
    except OSError:
        return None
    return xxhash.xxh3_128_hexdigest(f"{boot_id}|{netns.st_dev}:{netns.st_ino}|{os.getuid()}".encode())


class Staging:
    """`nbytes` of shared memory mapped into this process, as a uint8 tensor [nbytes]. Its pages are
    allocated at the first staged transfer (`reserve`), not before: where the direct lane takes every
    pull, the staging memory never holds a page (it held 32 MB per connection, in both processes' RSS)."""

    def __init__(self, fd: int, nbytes: int, owner_fd: int | None = None) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)
        self._owner_fd = owner_fd  # the creator's own descriptor, for `reserve`
        self.is_reserved = False

    @classmethod
    def create(cls, nbytes: int) -> tuple[Staging, int]:
        """A fresh sealed memfd (mode 0600) and its mapping; the caller closes the fd it is handed."""
        fd = os.memfd_create(STAGING_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _REQUIRED_SEALS)
            return cls(fd, nbytes, owner_fd=os.dup(fd)), fd
        except BaseException:
            os.close(fd)
            raise

    def reserve(self) -> None:
        """The creator allocates every page once, before its first staged transfer: memory the kernel cannot
        give fails here, as an OSError, instead of faulting a copy half-way (growth is sealed; filling the
        file's own size is not)."""
        if not self.is_reserved and self._owner_fd is not None:
            os.posix_fallocate(self._owner_fd, 0, self.nbytes)
            self.is_reserved = True

    @classmethod
    def adopt(cls, fd: int, nbytes: int) -> Staging:
        """Maps a peer's staging fd after checking it cannot shrink under the mapping, nor be read by others."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size < nbytes or info.st_mode & 0o077:
            raise KVTransferError(f"peer staging memory is not a private file of {nbytes} bytes")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _REQUIRED_SEALS != _REQUIRED_SEALS:
            raise KVTransferError("peer staging memory is not sealed against resizing")
        return cls(fd, nbytes)

    def slot(self, index: int, slot_nbytes: int) -> torch.Tensor:
        assert self.tensor is not None
        return self.tensor[index * slot_nbytes : (index + 1) * slot_nbytes]

    def close(self) -> None:
        if self._owner_fd is not None:
            os.close(self._owner_fd)
            self._owner_fd = None
        self.tensor = None  # the tensor holds a buffer export of the mapping: drop it before unmapping
        try:
            self._map.close()
        except BufferError:  # a view still lives somewhere: the mapping goes when it is collected
            pass


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(index in `block_ids`, first block id, count) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids):
        if runs and b == runs[-1][1] + runs[-1][2]:
            index, first, count = runs[-1]
            runs[-1] = (index, first, count + 1)
        else:
            runs.append((i, b, 1))
    return runs


def _span(pool: KVPoolIO, first: int, count: int) -> torch.Tensor:
    pool.block_tensor(first + count - 1)
    return pool.kv_pool.narrow(0, first, count).reshape(-1).view(torch.uint8)  # [count * block_nbytes]


def gather(pool: KVPoolIO, block_ids: Sequence[int], out: torch.Tensor) -> None:
    """Copies the blocks, in order, into out[: len(block_ids) * block_nbytes]."""
    n = pool.block_nbytes
    for index, first, count in block_runs(block_ids):
        out[index * n : (index + count) * n].copy_(_span(pool, first, count))


def scatter(pool: KVPoolIO, block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Copies data[: len(block_ids) * block_nbytes] into the blocks, in order."""
    n = pool.block_nbytes
    for index, first, count in block_runs(block_ids):
        _span(pool, first, count).copy_(data[index * n : (index + count) * n])


def handoff_digest(block_ids: Sequence[int], block_hashes: Sequence[int]) -> int:
    """What a pull says it expects; the exporter compares it with its export's (the UCX path compares
    the block hashes of the wire header instead)."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(block_ids)}Q{len(block_hashes)}Q", *block_ids, *block_hashes))


def peer_uid(sock: socket.socket) -> int:
    _, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return uid


def seqpacket_socket() -> socket.socket:
    return socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)


async def readable(sock: socket.socket, timeout_s: float | None) -> None:
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout_s)
    finally:
        loop.remove_reader(sock.fileno())


async def recv_with_fd(sock: socket.socket, nbytes: int, timeout_s: float) -> tuple[bytes, int | None]:
    """One message and the descriptor passed with it (None if none came); extra descriptors are closed."""
    await readable(sock, timeout_s)
    data, fds, flags, _ = socket.recv_fds(sock, nbytes, 1)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise KVTransferError("peer sent more descriptors than one")
    return data, (fds[0] if fds else None)


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
_IOV_MAX = 1024


def read_peer(pid: int, spans: Sequence[tuple[int, int, int]]) -> None:
    """Copies (local address, remote address, length) spans out of process `pid` (process_vm_readv: one
    kernel copy). Raises OSError: EPERM where this user may not read that process, ESRCH once it is gone,
    EFAULT for an address it does not map, EIO for a short copy."""
    for start in range(0, len(spans), _IOV_MAX):
        batch = spans[start : start + _IOV_MAX]
        local = (_IOVec * len(batch))(*[_IOVec(dst, n) for dst, _, n in batch])
        remote = (_IOVec * len(batch))(*[_IOVec(src, n) for _, src, n in batch])
        expected = sum(n for _, _, n in batch)
        got = _libc.process_vm_readv(pid, local, len(batch), remote, len(batch), 0)
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        if got != expected:
            raise OSError(errno.EIO, f"short copy from process {pid}: {got} of {expected} bytes")


def peer_pid(sock: socket.socket) -> int:
    """The peer's pid in this process's pid namespace (0 where it is not visible here)."""
    pid, _, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid


def can_read_peer(pid: int, address: int) -> bool:
    probe = ctypes.create_string_buffer(1)
    try:
        read_peer(pid, [(ctypes.addressof(probe), address, 1)])
    except OSError:
        return False
    return True


def direct_spans(pool: KVPoolIO, remote_base: int, src_ids: Sequence[int], dest_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(local address, remote address, length) of each run consecutive in both pools; block b of the remote
    pool starts at remote_base + b * block_nbytes (the pools share the layout)."""
    n = pool.block_nbytes
    spans: list[tuple[int, int, int]] = []
    for i, (src, dst) in enumerate(zip(src_ids, dest_ids)):
        if i and src == src_ids[i - 1] + 1 and dst == dest_ids[i - 1] + 1:
            local, remote, length = spans[-1]
            spans[-1] = (local, remote, length + n)
        else:
            spans.append((pool.block_tensor(dst).data_ptr(), remote_base + src * n, n))
    return spans
