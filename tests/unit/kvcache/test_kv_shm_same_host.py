"""SameHostFirst: the shared-memory path chosen by node id, the remote path otherwise or when the exporter's
socket cannot be reached, and a lease served once (the remote here is the in-process LocalTransport)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports import KVTransferError, create_transport
from pdserve.kvcache.transports.local import LocalHub, LocalTransport
from pdserve.kvcache.transports.same_host import SameHostFirst
from pdserve.kvcache.transports.shm import ShmTransport

LAYOUT = KVLayout("same-host-test", "float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
LEASE = "0123456789abcdef" * 2


def _pool(seed: int) -> KVPoolIO:
    gen = torch.Generator().manual_seed(seed)
    return KVPoolIO(torch.randn(16, 2, 2, 4, 2, 8, generator=gen))


class Pair:
    def __init__(self) -> None:
        hub = LocalHub()
        self.released: list[str] = []
        a, b = _pool(1), _pool(2)
        self.exporter = SameHostFirst(a, LAYOUT, self._release, remote=LocalTransport(a, LAYOUT, hub=hub),
                                      local=create_transport("shm", a, LAYOUT))
        self.importer = SameHostFirst(b, LAYOUT, remote=LocalTransport(b, LAYOUT, hub=hub), local=ShmTransport(b, LAYOUT))

    async def _release(self, lease_id: str) -> None:
        self.released.append(lease_id)

    async def wait_released(self) -> None:
        for _ in range(200):
            if self.released:
                return
            await asyncio.sleep(0.01)

    def assert_landed(self, src: list[int], dst: list[int]) -> None:
        for s, d in zip(src, dst):
            assert torch.equal(self.exporter.pool.block_tensor(s), self.importer.pool.block_tensor(d))


def test_a_peer_on_this_node_pulls_through_shared_memory_and_the_lease_is_served_once():
    async def main() -> None:
        pair = Pair()
        await pair.exporter.start()
        params = await pair.exporter.export(LEASE, [3, 4, 9], [11, 12], 10)
        assert params.node_id == pair.importer.local.node_id is not None  # this process: one node
        assert params.local_address == pair.exporter.local.address
        assert pair.exporter.exported_lease_ids() == [LEASE]
        assert await pair.importer.pull(params, [0, 1, 2]) == "shm"  # the path the metrics are labelled by
        pair.assert_landed([3, 4, 9], [0, 1, 2])
        assert pair.importer.pulls_by_path == {"shm": 1}
        assert pair.importer.bytes_pulled == 3 * LAYOUT.block_nbytes
        await pair.wait_released()
        assert pair.released == [LEASE] and pair.exporter.num_exports == 0
        # withdrawn from the remote path when the shared-memory side claimed it
        with pytest.raises(KVTransferError):
            await pair.importer.remote.pull(params, [5, 6, 7])
        await pair.importer.close()
        await pair.exporter.close()

    asyncio.run(main())


def test_another_node_or_an_unreachable_socket_takes_the_remote_path():
    async def main() -> None:
        pair = Pair()
        await pair.exporter.start()
        params = await pair.exporter.export(LEASE, [3, 4], [11], 7)
        elsewhere = dataclasses.replace(params, node_id="another-node")
        assert await pair.importer.pull(elsewhere, [0, 1]) == "local"
        assert pair.importer.pulls_by_path == {"local": 1}
        assert pair.released == [LEASE] and pair.exporter.num_exports == 0  # and withdrawn from shared memory

        params = await pair.exporter.export(LEASE[::-1], [5, 6], [13], 7)
        await pair.exporter.local.close()  # the socket is gone: nothing was asked of it, the remote serves
        await pair.importer.pull(params, [2, 3])
        pair.assert_landed([5, 6], [2, 3])
        assert pair.importer.pulls_by_path == {"local": 2, "shm_unreachable": 1}
        await pair.importer.close()
        await pair.exporter.close()

    asyncio.run(main())


def test_forget_withdraws_both_paths():
    async def main() -> None:
        pair = Pair()
        await pair.exporter.start()
        params = await pair.exporter.export(LEASE, [3], [], 2)
        assert pair.exporter.forget(LEASE) and pair.exporter.num_exports == 0
        with pytest.raises(KVTransferError, match="refused"):
            await pair.importer.local.pull(params, [0])
        with pytest.raises(KVTransferError):
            await pair.importer.remote.pull(params, [0])
        assert not pair.importer.pool.block_tensor(0).equal(pair.exporter.pool.block_tensor(3))
        await pair.importer.close()
        await pair.exporter.close()

    asyncio.run(main())
