"""The other process of tests/unit/kvcache/test_kv_shm.py: a shared-memory exporter or importer run in
its own OS process (multiprocessing spawn). Commands and answers are JSON over a multiprocessing
connection's byte messages.

Not collected by pytest (no test_ prefix); test_kv_shm.py puts this folder on sys.path so that spawned
children import it by name.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import os
import socket

import torch
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports import KVTransferError, shm_io
from pdserve.kvcache.transports.shm import ShmConfig, ShmTransport

LAYOUT = KVLayout("shm-test", "float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)  # 1 KiB blocks


def seeded_pool(num_blocks: int, seed: int) -> KVPoolIO:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return KVPoolIO(torch.randn(shape, generator=gen))


def blocks_digest(pool: KVPoolIO, block_ids: list[int]) -> str:
    digest = hashlib.sha256()
    for b in block_ids:
        digest.update(pool.block_tensor(b).numpy().tobytes())
    return digest.hexdigest()


def _send(conn, message: dict) -> None:
    conn.send_bytes(json.dumps(message).encode())


async def _command(conn) -> dict:
    return json.loads(await asyncio.get_running_loop().run_in_executor(None, conn.recv_bytes))


def exporter(conn, num_blocks: int, seed: int, slot_blocks: int, exports: list[list[int]]) -> None:
    """Exports one lease per block id list in `exports`, sends their params, then answers "state",
    "forget" and "quit" commands while serving."""

    async def main() -> None:
        released: list[str] = []

        async def release(lease_id: str) -> None:
            released.append(lease_id)

        transport = ShmTransport(seeded_pool(num_blocks, seed), LAYOUT, release,
                                 config=ShmConfig(slot_bytes=slot_blocks * LAYOUT.block_nbytes, timeout_s=5.0))
        await transport.start()
        params = []
        for i, block_ids in enumerate(exports):
            lease_id = f"{i:032x}"
            hashes = list(range(1000 * i, 1000 * i + len(block_ids)))
            params.append((await transport.export(lease_id, block_ids, hashes, len(block_ids) * LAYOUT.block_size)).to_dict())
        _send(conn, {"pid": os.getpid(), "params": params})
        while True:
            command = await _command(conn)
            if command["op"] == "forget":
                transport.forget(command["lease_id"])
            if command["op"] == "quit":
                break
            _send(conn, {"released": released, "exports": transport.exported_lease_ids(),
                         "num_connections": len(transport._handlers), "num_pieces_sent": transport.num_pieces_sent,
                         "num_refused_pulls": transport.num_refused_pulls})
        await transport.close()
        _send(conn, {"closed": True})

    asyncio.run(main())


def importer(conn, num_blocks: int) -> None:
    """Pulls each params dict it is sent into blocks 0.. of a zeroed pool and answers with the pulled
    bytes' checksum, or the error."""

    async def main() -> None:
        transport = ShmTransport(KVPoolIO(torch.zeros_like(seeded_pool(num_blocks, 0).kv_pool)), LAYOUT,
                                 config=ShmConfig(slot_bytes=LAYOUT.block_nbytes, timeout_s=5.0))
        _send(conn, {"pid": os.getpid()})
        while (command := await _command(conn))["op"] == "pull":
            params = HandoffParams.from_dict(command["params"])
            dest = list(range(len(params.block_ids)))
            try:
                await transport.pull(params, dest)
            except (KVTransferError, ValueError, OSError) as e:  # reported to the test, which decides
                _send(conn, {"error": f"{type(e).__name__}: {e}"})
                continue
            _send(conn, {"sha256": blocks_digest(transport.pool, dest)})
        await transport.close()

    asyncio.run(main())


def stranger(conn, uid: int, address: str, exporter_pid: int, pool_address: int) -> None:
    """As another user: connect to an exporter's socket, look for its staging memory under /proc, and read
    its pool directly."""
    os.setgid(uid)
    os.setuid(uid)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(5.0)
    sock.connect("\0" + address)
    data, fds, _, _ = socket.recv_fds(sock, 64, 1)
    opened = []
    for name in os.listdir(f"/proc/{exporter_pid}/map_files") if os.access(f"/proc/{exporter_pid}/map_files", os.R_OK) else []:
        try:
            with open(f"/proc/{exporter_pid}/map_files/{name}", "rb"):
                opened.append(name)
        except OSError:
            pass
    fd_dir = f"/proc/{exporter_pid}/fd"
    try:
        fd_names = os.listdir(fd_dir)
    except OSError as e:
        fd_names = [f"denied: {e.errno}"]
    probe = ctypes.create_string_buffer(8)
    try:
        shm_io.read_peer(exporter_pid, [(ctypes.addressof(probe), pool_address, 8)])
        direct = "read"
    except OSError as e:
        direct = f"denied: {e.errno}"
    _send(conn, {"hello_bytes": len(data), "fds": len(fds), "opened_maps": opened, "fd_dir": fd_names,
                 "direct_read": direct})
