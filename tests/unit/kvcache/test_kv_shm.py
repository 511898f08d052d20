"""Shared-memory KV transport between real OS processes (multiprocessing spawn): bytes, access control,
and kill -9 of either side mid-transfer."""

from __future__ import annotations

import asyncio
import errno
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Self

import pytest
import torch
from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports import KVTransferError
from pdserve.kvcache.transports.shm import ShmConfig, ShmTransport
from pdserve.kvcache.transports.shm_io import STAGING_NAME

sys.path.insert(0, str(Path(__file__).parent))  # spawned children import the peers by name
import shm_peers
from shm_peers import LAYOUT, blocks_digest, seeded_pool

SPAWN = multiprocessing.get_context("spawn")


class Peer:
    """A child process running one of shm_peers' roles; killed on exit if still alive."""

    def __init__(self, role, *args) -> None:
        self.conn, child_conn = SPAWN.Pipe()
        self.process = SPAWN.Process(target=role, args=(child_conn, *args), daemon=True)
        self.process.start()
        self.hello = self.recv(timeout_s=60)

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message: dict) -> None:
        self.conn.send_bytes(json.dumps(message).encode())

    def recv(self, timeout_s: float = 20) -> dict:
        assert self.conn.poll(timeout_s), "the peer process did not answer"
        return json.loads(self.conn.recv_bytes())

    def ask(self, message: dict) -> dict:
        self.send(message)
        return self.recv()

    async def ask_async(self, message: dict) -> dict:
        return await asyncio.get_running_loop().run_in_executor(None, self.ask, message)

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def staging_mappings(pid: int | str = "self") -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if f"memfd:{STAGING_NAME}" in line]


def staging_rss_kb() -> int:
    """Resident kB of this process's staging mappings."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:
                inside = f"memfd:{STAGING_NAME}" in line
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def our_shm_files() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(("pdkv", "pdserve"))}


def stop_when(counter, at_least: int, pid: int) -> threading.Thread:
    """SIGSTOPs `pid` once counter() reaches `at_least`: the exporter then holds at most its slots in
    flight, so a transfer longer than that stalls mid-way, whatever the timing."""

    def watch() -> None:
        deadline = time.monotonic() + 30
        while counter() < at_least and time.monotonic() < deadline:
            time.sleep(0.0005)
        os.kill(pid, signal.SIGSTOP)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def importer_pool(num_blocks: int) -> KVPoolIO:
    return KVPoolIO(torch.zeros_like(seeded_pool(num_blocks, 0).kv_pool))


@pytest.mark.parametrize("direct_read", [True, False], ids=["direct", "staged"])
def test_blocks_cross_between_two_processes_bit_exact_and_the_lease_is_released(direct_read):
    src_ids = [[3, 4, 5, 9, 12, 13, 0, 1, 2, 30], list(range(40))]  # runs, singletons; then longer than slots
    before = our_shm_files()
    with Peer(shm_peers.exporter, 48, 11, 3, src_ids) as exporter:
        expected = seeded_pool(48, 11)
        importer = ShmTransport(importer_pool(48), LAYOUT, config=ShmConfig(timeout_s=5.0, direct_read=direct_read))

        async def main() -> None:
            for params, ids in zip(exporter.hello["params"], src_ids):
                dest = list(range(47, 47 - len(ids), -1))  # no run lines up with the source's
                await importer.pull(HandoffParams.from_dict(params), dest)
                for s, d in zip(ids, dest):
                    assert torch.equal(importer.pool.block_tensor(d), expected.block_tensor(s))
            assert importer.client.num_connections_opened == 1  # the second pull reused the connection
            assert (importer.client.num_direct_pulls, importer.client.num_staged_pulls) == ((2, 0) if direct_read else (0, 2))
            assert len(staging_mappings()) == 1
            # the direct lane never touches the staging memory, so it holds no page; the staged one filled it
            assert (staging_rss_kb() == 0) == direct_read, staging_rss_kb()
            await importer.close()

        asyncio.run(main())
        deadline = time.monotonic() + 5
        while len((state := exporter.ask({"op": "state"}))["released"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sorted(state["released"]) == sorted(p["lease_id"] for p in exporter.hello["params"])
        assert state["exports"] == [] and state["num_pieces_sent"] == (0 if direct_read else 4 + 14)
        assert staging_mappings() == []  # closed: the importer unmapped its staging memory
    assert our_shm_files() == before


def test_a_wrong_secret_is_refused_before_any_block_moves():
    with Peer(shm_peers.exporter, 16, 5, 4, [[1, 2, 3]]) as exporter:
        params = HandoffParams.from_dict(exporter.hello["params"][0])
        importer = ShmTransport(importer_pool(16), LAYOUT, config=ShmConfig(timeout_s=5.0))

        async def main() -> None:
            for secret in ("0" * 32, params.secret[:-1], ""):
                forged = HandoffParams.from_dict({**params.to_dict(), "secret": secret})
                with pytest.raises(KVTransferError, match="refused"):
                    await importer.pull(forged, [4, 5, 6])
            assert not importer.pool.kv_pool.any()  # nothing landed
            await importer.pull(params, [4, 5, 6])  # the handoff's holder still gets it
            assert torch.equal(importer.pool.block_tensor(6), seeded_pool(16, 5).block_tensor(3))
            await importer.close()

        asyncio.run(main())
        assert exporter.ask({"op": "state"})["num_refused_pulls"] == 3


def test_staging_memory_is_private_sealed_and_nameless(tmp_path):
    from pdserve.kvcache.transports import shm_io

    before = set(os.listdir("/dev/shm"))
    staging, fd = shm_io.Staging.create(1 << 20)
    try:
        assert os.fstat(fd).st_mode & 0o777 == 0o600
        assert set(os.listdir("/dev/shm")) - before == set()  # no name anywhere to guess or to leak
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 4096)  # sealed: a mapping of it can never run past the end of the file
        shm_io.Staging.adopt(fd, 1 << 20).close()
    finally:
        os.close(fd)
        staging.close()
    # what an importer refuses: memory others may read, or memory its peer could shrink under the mapping
    open_fd = os.memfd_create("open", os.MFD_ALLOW_SEALING)
    unsealed = os.memfd_create("unsealed")
    try:
        for fd in (open_fd, unsealed):
            os.ftruncate(fd, 1 << 20)
        os.fchmod(open_fd, 0o644)
        os.fchmod(unsealed, 0o600)
        with pytest.raises(KVTransferError, match="private"):
            shm_io.Staging.adopt(open_fd, 1 << 20)
        with pytest.raises(KVTransferError, match="sealed"):
            shm_io.Staging.adopt(unsealed, 1 << 20)
    finally:
        os.close(open_fd)
        os.close(unsealed)


@pytest.mark.parametrize("direct_read", [True, False], ids=["direct", "staged"])
def test_a_slow_release_does_not_hold_the_next_pull_on_the_connection(direct_read):
    # the engine frees a lease between steps, a whole prefill step away at worst: the exporter's connection
    # must serve the next pull meanwhile, or that request's first decode step waits for the prefill step
    async def main() -> None:
        gate, released = asyncio.Event(), []

        async def engine_mid_step(lease_id: str) -> None:
            await gate.wait()
            released.append(lease_id)

        exporter = ShmTransport(seeded_pool(16, 3), LAYOUT, engine_mid_step, config=ShmConfig(direct_read=direct_read))
        importer = ShmTransport(importer_pool(16), LAYOUT)
        await exporter.start()
        try:
            first = await exporter.export("ab" * 16, [1, 2], [7, 8], 8)
            second = await exporter.export("cd" * 16, [3, 4, 5], [9, 10, 11], 12)
            await asyncio.wait_for(importer.pull(first, [0, 1]), 15)
            await asyncio.wait_for(importer.pull(second, [2, 3, 4]), 15)
            assert blocks_digest(importer.pool, [2, 3, 4]) == blocks_digest(exporter.pool, [3, 4, 5])
            deadline = time.monotonic() + 5
            while exporter.num_exports and time.monotonic() < deadline:  # the ack lands after pull returns
                await asyncio.sleep(0.01)
            assert released == [] and exporter.num_exports == 0  # both served, neither released yet
            gate.set()
            while len(released) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert sorted(released) == ["ab" * 16, "cd" * 16]
        finally:
            await importer.close()
            await exporter.close()

    asyncio.run(main())


@pytest.mark.skipif(os.getuid() != 0, reason="switching to another user needs root")
def test_another_user_gets_no_staging_memory_and_cannot_read_the_exporters():
    async def main() -> dict:
        released: list[str] = []

        async def release(lease_id: str) -> None:
            released.append(lease_id)

        exporter = ShmTransport(seeded_pool(16, 3), LAYOUT, release)
        importer = ShmTransport(importer_pool(16), LAYOUT)
        await exporter.start()
        params = await exporter.export("ab" * 16, [1, 2], [7, 8], 8)
        await importer.pull(params, [0, 1])  # a legitimate peer now holds a connection and its staging
        assert len(staging_mappings()) == 2
        loop = asyncio.get_running_loop()  # the exporter must accept while the stranger connects
        stranger = await loop.run_in_executor(None, Peer, shm_peers.stranger, 65534, exporter.address, os.getpid(),
                                              exporter.pool.kv_pool.data_ptr())
        stranger.kill()
        seen = stranger.hello
        await importer.close()
        await exporter.close()
        return seen

    seen = asyncio.run(main())
    assert seen["hello_bytes"] == 0 and seen["fds"] == 0  # turned away before HELLO and its memfd
    assert seen["opened_maps"] == []
    assert seen["fd_dir"][0].startswith("denied")
    assert seen["direct_read"].startswith("denied")  # nor read the exporter's pool (process_vm_readv)


def test_a_direct_read_of_a_dead_or_unmapped_peer_fails_cleanly():
    from pdserve.kvcache.transports import shm_io

    pool = importer_pool(4)
    with Peer(shm_peers.exporter, 8, 1, 2, [[1]]) as exporter:
        pid = exporter.pid
        with pytest.raises(OSError) as unmapped:
            shm_io.read_peer(pid, [(pool.block_tensor(0).data_ptr(), 4096, LAYOUT.block_nbytes)])
        assert unmapped.value.errno == errno.EFAULT
        exporter.kill()
    with pytest.raises(OSError) as gone:
        shm_io.read_peer(pid, [(pool.block_tensor(0).data_ptr(), 1 << 30, LAYOUT.block_nbytes)])
    assert gone.value.errno == errno.ESRCH
    assert not pool.kv_pool.any()


def test_exporter_killed_mid_transfer_fails_the_pull_cleanly_and_leaves_nothing_mapped():
    num_blocks = 4096  # 1-block slots: 4096 pieces, far more than the few an exporter can have in flight
    before = our_shm_files()
    with Peer(shm_peers.exporter, num_blocks, 2, 1, [list(range(num_blocks))]) as exporter:
        params = HandoffParams.from_dict(exporter.hello["params"][0])
        importer = ShmTransport(importer_pool(num_blocks), LAYOUT, config=ShmConfig(timeout_s=5.0, direct_read=False))

        async def main() -> None:
            watcher = stop_when(lambda: importer.client.num_pieces_received, 1, exporter.pid)
            pull = asyncio.ensure_future(importer.pull(params, list(range(num_blocks))))
            await asyncio.get_running_loop().run_in_executor(None, watcher.join)
            assert not pull.done() and importer.client.num_pieces_received < num_blocks
            exporter.kill()  # SIGKILL of the stopped exporter
            with pytest.raises(KVTransferError, match="went away"):
                await pull
            assert staging_mappings() == [] and importer.client.num_idle_connections == 0
            # the surviving importer keeps working: a fresh exporter's handoff lands bit-exact
            with Peer(shm_peers.exporter, 8, 9, 2, [[5, 6, 7]]) as second:
                await importer.pull(HandoffParams.from_dict(second.hello["params"][0]), [0, 1, 2])
                assert torch.equal(importer.pool.block_tensor(2), seeded_pool(8, 9).block_tensor(7))
            await importer.close()
            assert staging_mappings() == []

        asyncio.run(main())
    assert our_shm_files() == before


def test_importer_killed_mid_transfer_leaves_the_exporter_serving_and_the_lease_retryable():
    num_blocks = 4096
    released: list[str] = []

    async def release(lease_id: str) -> None:
        released.append(lease_id)

    async def main() -> None:
        exporter = ShmTransport(seeded_pool(num_blocks, 4), LAYOUT, release,  # no direct reads: staged pieces
                                config=ShmConfig(slot_bytes=LAYOUT.block_nbytes, timeout_s=5.0, direct_read=False))
        await exporter.start()
        params = await exporter.export("cd" * 16, list(range(num_blocks)), [], num_blocks * LAYOUT.block_size - 1)
        with Peer(shm_peers.importer, num_blocks) as importer:
            watcher = stop_when(lambda: exporter.num_pieces_sent, 1, importer.pid)
            importer.send({"op": "pull", "params": params.to_dict()})
            await asyncio.get_running_loop().run_in_executor(None, watcher.join)
            assert exporter.num_pieces_sent < num_blocks  # mid-transfer
            importer.kill()
            for _ in range(500):  # the exporter sees EOF on its next wait
                if not exporter._handlers:
                    break
                await asyncio.sleep(0.01)
        assert not exporter._handlers and staging_mappings() == []
        assert exporter.exported_lease_ids() == [params.lease_id] and released == []  # kept for a retry
        with Peer(shm_peers.importer, num_blocks) as retry:
            answer = await retry.ask_async({"op": "pull", "params": params.to_dict()})
            assert answer == {"sha256": blocks_digest(seeded_pool(num_blocks, 4), list(range(num_blocks)))}
        for _ in range(500):
            if released:
                break
            await asyncio.sleep(0.01)
        assert released == [params.lease_id] and exporter.num_exports == 0
        # a lease nobody pulls: expiry forgets it (as KVExporter.forget_expired does), and nothing is left
        other = await exporter.export("ef" * 16, [1, 2], [], 5)
        assert exporter.forget(other.lease_id) and exporter.num_exports == 0
        await exporter.close()
        assert staging_mappings() == []

    before = our_shm_files()
    asyncio.run(main())
    assert our_shm_files() == before
