"""KV access control over real UCX endpoints on loopback: only the holder of a handoff's params (lease id
and per-handoff secret) can pull its blocks. (The listener listens on every interface: ucxx 0.52 has no
bind address, and filtering by ucp_ep_query segfaulted UCX; see ucx_env.create_listener.)"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid

import pytest
import torch

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports import KVTransferError
from pdserve.kvcache.transports.ucx import UCXConfig, UCXTransport, apply_ucx_env

apply_ucx_env(UCXConfig())  # before libucx loads
ucxx = pytest.importorskip("ucxx")

NUM_BLOCKS = 16
SRC_IDS = [2, 3, 4, 9]
DST_IDS = [5, 6, 7, 11]
LAYOUT = KVLayout("access-test", "float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
ERROR_HANDLING = pytest.mark.parametrize("error_handling", [True, False], ids=["eh", "no-eh"])


def _pool(seed: int) -> KVPoolIO:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return KVPoolIO(torch.randn(shape, generator=gen))


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture(autouse=True)
def no_ucx_leftovers():
    yield
    assert ucxx.core._ctx is None
    assert not [t for t in threading.enumerate() if "UCX" in t.name]


async def _pair(error_handling: bool, host: str = "127.0.0.1") -> tuple[UCXTransport, UCXTransport, list[str]]:
    config = UCXConfig(endpoint_error_handling=error_handling)
    released: list[str] = []

    async def release(lease_id: str) -> None:
        released.append(lease_id)

    exporter = UCXTransport(_pool(1), LAYOUT, release, host=host, timeout_s=5.0, config=config)
    importer = UCXTransport(_pool(2), LAYOUT, timeout_s=5.0, config=config)
    await exporter.start()
    return exporter, importer, released


async def _export(exporter: UCXTransport):
    hashes = list(range(7, 7 + len(SRC_IDS)))
    return await exporter.export(uuid.uuid4().hex, SRC_IDS, hashes, len(SRC_IDS) * LAYOUT.block_size)


@ERROR_HANDLING
@pytest.mark.parametrize("secret", ["", "0" * 32, "guess"], ids=["missing", "zeros", "wrong"])
def test_a_pull_without_the_handoff_secret_is_refused_and_nothing_leaks(error_handling, secret):
    async def main():
        exporter, importer, released = await _pair(error_handling)
        try:
            params = await _export(exporter)
            assert len(params.secret) == 32 and params.secret not in repr(params)
            before = importer.pool.kv_pool.clone()
            with pytest.raises(KVTransferError, match="refused") as refused:
                await importer.pull(dataclasses.replace(params, secret=secret), DST_IDS)
            # the same answer as for a lease that does not exist: no oracle for lease ids
            assert "unknown, expired or busy lease" in str(refused.value)
            assert exporter.num_refused_pulls == 1
            assert torch.equal(importer.pool.kv_pool, before) and importer.bytes_pulled == 0
            assert exporter.exported_lease_ids() == [params.lease_id] and released == []
            # the holder still pulls it, over the same connection: no stray KV message was sent before it
            await importer.pull(params, DST_IDS)
            assert importer.num_connections_opened == 1
            assert torch.equal(importer.pool.kv_pool[DST_IDS], exporter.pool.kv_pool[SRC_IDS])
            await _until(lambda: released == [params.lease_id] and exporter.num_exports == 0)
        finally:
            await importer.close()
            await exporter.close()

    asyncio.run(main())


def test_a_lease_id_alone_is_not_enough_even_for_a_second_try():
    async def main():
        exporter, importer, _ = await _pair(True)
        try:
            params = await _export(exporter)
            for guess in ("a" * 32, "b" * 32, params.secret[:-1] + "x"):
                with pytest.raises(KVTransferError, match="refused"):
                    await importer.pull(dataclasses.replace(params, secret=guess), DST_IDS)
            assert exporter.num_refused_pulls == 3 and exporter.num_exports == 1
        finally:
            await importer.close()
            await exporter.close()

    asyncio.run(main())


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"], ids=["configured", "wildcard"])
def test_connections_on_the_configured_address_are_served(host):
    async def main():
        exporter, importer, _ = await _pair(True, host=host)
        try:
            params = await _export(exporter)
            await importer.pull(dataclasses.replace(params, address="127.0.0.1"), DST_IDS)
            assert torch.equal(importer.pool.kv_pool[DST_IDS], exporter.pool.kv_pool[SRC_IDS])
        finally:
            await importer.close()
            await exporter.close()

    asyncio.run(main())
