"""UCX transport over real UCX endpoints on loopback (tcp/cma/self), in one process and across two."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Self

import pytest
import torch

from pdserve.kvcache.layout import KVLayout, LayoutMismatch
from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports import KVTransferError, create_transport
from pdserve.kvcache.transports.ucx import UCXConfig, UCXTransport, apply_ucx_env
from pdserve.kvcache.wire import WireError

apply_ucx_env(UCXConfig())  # before libucx loads: it reads UCX_WARN_UNUSED_ENV_VARS then
ucxx = pytest.importorskip("ucxx")

NUM_BLOCKS = 24
SRC_IDS = [3, 4, 5, 9, 12, 13, 0]  # runs of consecutive ids and singletons
DST_IDS = [20, 21, 7, 8, 9, 1, 15]  # runs that do not line up with the source runs
HANG_BOUND_S = 15.0  # well above the 1 s timeouts on a loaded 2-core CI machine; without them a pull hangs


def _layout(dtype: str = "float32", block_size: int = 4) -> KVLayout:
    return KVLayout("ucx-test", dtype, num_layers=2, num_kv_heads=2, head_dim=8, block_size=block_size)


def _pool(layout: KVLayout, seed: int) -> KVPoolIO:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return KVPoolIO(torch.randn(shape, generator=gen).to(getattr(torch, layout.dtype)))


def _lease() -> str:
    return uuid.uuid4().hex


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class Pair:
    """An exporting transport on pool A and an importing one on pool B, closed on exit."""

    def __init__(self, layout: KVLayout | None = None, exporter_cls=UCXTransport, importer_cls=UCXTransport,
                 exporter_config: UCXConfig | None = None, **importer_kwargs) -> None:
        self.layout = layout or _layout()
        self.a, self.b = _pool(self.layout, 1), _pool(self.layout, 2)
        self.released: list[str] = []
        self.exporter = exporter_cls(self.a, self.layout, self._release, timeout_s=5.0, config=exporter_config)
        self.importer = importer_cls(self.b, self.layout, **{"timeout_s": 5.0, **importer_kwargs})

    async def _release(self, lease_id: str) -> None:
        self.released.append(lease_id)

    async def __aenter__(self) -> Self:
        await self.exporter.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.importer.close()
        await self.exporter.close()

    async def export(self, block_ids=SRC_IDS) -> HandoffParams:
        hashes = list(range(101, 101 + len(block_ids) - 1))  # the tail block is partial: no hash
        return await self.exporter.export(_lease(), list(block_ids), hashes, len(block_ids) * 4 - 1)


@pytest.fixture(autouse=True)
def no_ucx_leftovers(caplog):
    yield
    # closing the last transport tears the UCX context down: no endpoint, listener or thread survives
    assert not [r for r in caplog.records if "not torn down" in r.getMessage()]
    assert ucxx.core._ctx is None
    assert not [t for t in threading.enumerate() if "UCX" in t.name]


@pytest.mark.parametrize("error_handling", [True, False], ids=["eh", "no-eh"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_round_trip_is_bit_exact_across_block_ids(dtype, error_handling):
    config = UCXConfig(endpoint_error_handling=error_handling)
    async def main():
        async with Pair(_layout(dtype), exporter_config=config, config=config) as p:
            before = p.b.kv_pool.clone()
            params = await p.export()
            assert (params.transport, params.address, params.port) == ("ucx", "127.0.0.1", p.exporter.port)
            await p.importer.pull(params, DST_IDS)
            assert torch.equal(p.b.kv_pool[DST_IDS].view(torch.uint8), p.a.kv_pool[SRC_IDS].view(torch.uint8))
            untouched = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
            assert torch.equal(p.b.kv_pool[untouched].view(torch.uint8), before[untouched].view(torch.uint8))
            await _until(lambda: p.released == [params.lease_id])
            assert p.exporter.num_exports == 0

    asyncio.run(main())


def test_error_handling_mismatch_is_refused_clearly():
    # both sides must agree; UCX refuses the asymmetric endpoint, and the pull fails fast and cleanly
    async def main():
        async with Pair(exporter_config=UCXConfig(endpoint_error_handling=True),
                        config=UCXConfig(endpoint_error_handling=False)) as p:
            before = p.b.kv_pool.clone()
            params = await p.export()
            start = time.monotonic()
            with pytest.raises(KVTransferError, match="connect"):
                await p.importer.pull(params, DST_IDS)
            assert time.monotonic() - start < HANG_BOUND_S  # bounded by the connect timeout: no hang
            assert torch.equal(p.b.kv_pool, before)
            assert p.exporter.num_exports == 1 and p.released == []  # still held: the lease expires or a retry pulls

    asyncio.run(main())


def test_registry_builds_the_ucx_transport():
    layout = _layout()
    transport = create_transport("ucx", _pool(layout, 0), layout, port=0, timeout_s=1.0)
    assert isinstance(transport, UCXTransport) and transport.name == "ucx"


def test_release_only_after_the_importers_ack():
    class AckLost(UCXTransport):
        async def _step(self, awaitable, what, peer):
            if what == "send the ack":
                awaitable.close()
                raise KVTransferError("test: ack lost")
            return await super()._step(awaitable, what, peer)

    async def main():
        async with Pair(importer_cls=AckLost) as p:
            params = await p.export()
            await p.importer.pull(params, DST_IDS)  # verified blocks are kept though the ack is lost
            assert torch.equal(p.b.kv_pool[DST_IDS], p.a.kv_pool[SRC_IDS])
            await _until(lambda: params.lease_id in p.exporter._exports)  # no ack: exported again, not released
            assert p.released == []

            retry = UCXTransport(p.b, p.layout, timeout_s=5.0)
            try:
                await retry.pull(params, DST_IDS)
            finally:
                await retry.close()
            await _until(lambda: p.released == [params.lease_id])

    asyncio.run(main())


def test_a_slow_release_does_not_hold_the_next_pull_on_the_connection():
    # the engine frees a lease between steps, a whole prefill step away at worst: the exporter's connection
    # must serve the next pull meanwhile, or that request's first decode step waits for the prefill step
    gate = asyncio.Event()

    async def main():
        async with Pair() as p:
            async def engine_mid_step(lease_id: str) -> None:
                await gate.wait()
                p.released.append(lease_id)

            p.exporter.release = engine_mid_step
            first, second = await p.export(), await p.export([1, 2, 6, 7, 8, 10, 11])
            await asyncio.wait_for(p.importer.pull(first, DST_IDS), HANG_BOUND_S)
            await asyncio.wait_for(p.importer.pull(second, DST_IDS), HANG_BOUND_S)
            assert p.importer.num_connections_opened == 1  # the second pull went over the first's connection
            assert torch.equal(p.b.kv_pool[DST_IDS], p.a.kv_pool[[1, 2, 6, 7, 8, 10, 11]])
            await _until(lambda: p.exporter.num_exports == 0)  # both acked (the ack lands after pull returns)
            assert p.released == []  # neither released yet
            gate.set()
            await _until(lambda: sorted(p.released) == sorted([first.lease_id, second.lease_id]))

    asyncio.run(main())


def test_unknown_lease_is_refused_and_nothing_is_written():
    async def main():
        async with Pair() as p:
            good = await p.export()
            bogus = HandoffParams("ucx", p.layout.layout_hash, _lease(), 5, good.block_ids, (), "127.0.0.1",
                                  p.exporter.port)
            before = p.b.kv_pool.clone()
            with pytest.raises(KVTransferError, match="unknown, expired or busy lease"):
                await p.importer.pull(bogus, DST_IDS)
            assert torch.equal(p.b.kv_pool, before)
            await p.importer.pull(good, DST_IDS)  # the refused exchange left the connection clean
            assert p.importer.num_connections_opened == 1
            assert torch.equal(p.b.kv_pool[DST_IDS], p.a.kv_pool[SRC_IDS])

    asyncio.run(main())


def test_layout_mismatch_before_any_network_io():
    async def main():
        layout = _layout()
        importer = UCXTransport(_pool(layout, 2), layout, timeout_s=1.0)
        other = _layout(block_size=8)
        params = HandoffParams("ucx", other.layout_hash, _lease(), 5, (1, 2), (), "127.0.0.1", 1)  # nobody listens
        before = importer.pool.kv_pool.clone()
        try:
            with pytest.raises(LayoutMismatch):
                await importer.pull(params, [3, 4])
        finally:
            await importer.close()
        assert importer.num_connections_opened == 0
        assert torch.equal(importer.pool.kv_pool, before)

    asyncio.run(main())


def test_corrupt_payload_zeroes_destination_and_keeps_other_blocks():
    async def main():
        async with Pair() as p:
            params = await p.export()
            p.a.block_tensor(SRC_IDS[2])[17] ^= 0xFF  # the source changes after its checksum was taken
            before = p.b.kv_pool.clone()
            with pytest.raises(WireError, match="corrupt KV block 2"):
                await p.importer.pull(params, DST_IDS)
            assert not p.b.kv_pool[DST_IDS].view(torch.uint8).any()
            untouched = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
            assert torch.equal(p.b.kv_pool[untouched], before[untouched])
            await asyncio.sleep(0.2)
            assert p.released == []

    asyncio.run(main())


def test_exporter_gone_fails_within_the_timeout():
    async def main():
        async with Pair(timeout_s=1.0) as p:
            first, second = await p.export(), await p.export()
            await p.importer.pull(first, DST_IDS)  # leaves a pooled connection to the exporter
            await p.exporter.close()
            for importer in (p.importer, UCXTransport(p.b, p.layout, timeout_s=1.0)):  # pooled, fresh
                start = time.monotonic()
                try:
                    with pytest.raises(KVTransferError):
                        await importer.pull(second, DST_IDS)
                finally:
                    await importer.close()
                assert time.monotonic() - start < HANG_BOUND_S

    asyncio.run(main())


def test_connections_are_reused_and_bounded():
    async def main():
        async with Pair(max_connections=2) as p:
            for _ in range(3):
                await p.importer.pull(await p.export(), DST_IDS)
            assert p.importer.num_connections_opened == 1

            exports = [await p.export([i]) for i in range(NUM_BLOCKS // 2)]
            await asyncio.gather(*(p.importer.pull(e, [NUM_BLOCKS - 1 - i]) for i, e in enumerate(exports)))
            assert p.importer.num_connections_opened <= 2
            assert torch.equal(p.b.kv_pool[NUM_BLOCKS // 2:].flip(0), p.a.kv_pool[: NUM_BLOCKS // 2])
            await _until(lambda: len(p.released) == 3 + len(exports))

    asyncio.run(main())


def test_timed_out_transfer_drops_the_connection_and_a_retry_succeeds():
    class SlowPayload:
        """The exporter's endpoint, with its payload sends (pool views, not bytes) held back 1 s."""

        def __init__(self, ep):
            self.ep = ep

        def __getattr__(self, name):
            return getattr(self.ep, name)

        async def send(self, buf):
            if not isinstance(buf, bytes):
                await asyncio.sleep(1.0)
            return await self.ep.send(buf)

    class Stalling(UCXTransport):
        stall = True

        async def _serve_one(self, ep, request):
            stall, self.stall = self.stall, False
            return await super()._serve_one(SlowPayload(ep) if stall else ep, request)

    async def main():
        async with Pair(exporter_cls=Stalling, timeout_s=0.3) as p:
            params = await p.export()
            with pytest.raises(KVTransferError, match="timed out after 0.3s"):
                await p.importer.pull(params, DST_IDS)
            assert not p.b.kv_pool[DST_IDS].any()
            await _until(lambda: params.lease_id in p.exporter._exports)
            await p.importer.pull(params, DST_IDS)
            assert p.importer.num_connections_opened == 2  # the timed-out connection was not reused
            assert torch.equal(p.b.kv_pool[DST_IDS], p.a.kv_pool[SRC_IDS])
            await _until(lambda: p.released == [params.lease_id])

    asyncio.run(main())


def test_forget_then_pull_fails():
    async def main():
        async with Pair() as p:
            params = await p.export()
            assert p.exporter.forget(params.lease_id)
            assert not p.exporter.forget(params.lease_id)
            with pytest.raises(KVTransferError, match="unknown"):
                await p.importer.pull(params, DST_IDS)
            assert p.released == []

    asyncio.run(main())


_EXPORTER = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[4])
from pdserve.kvcache.transports.ucx import UCXConfig, UCXTransport
from test_ucx_transport import _layout, _pool

async def main():
    layout = _layout(sys.argv[1])
    pool = _pool(layout, 1)
    released = asyncio.Event()

    async def release(lease_id):
        print("PDKV", json.dumps({"released": lease_id}), flush=True)
        released.set()

    config = UCXConfig(endpoint_error_handling=sys.argv[5] == "eh")
    transport = UCXTransport(pool, layout, release, timeout_s=10.0, config=config)
    await transport.start()
    try:
        params = await transport.export(sys.argv[2], json.loads(sys.argv[3]), [7, 8, 9], 27)
        print("PDKV", json.dumps(params.to_dict()), flush=True)
        await asyncio.wait_for(released.wait(), 20)
    finally:
        await transport.close()

asyncio.run(main())
"""


async def _next_message(proc, timeout_s: float) -> dict:
    """The child's next JSON line (UCX logs to stdout too, so ours carry a marker)."""
    while True:
        line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
        assert line, "exporter process ended early"
        if line.startswith(b"PDKV "):
            return json.loads(line[5:])


@pytest.mark.parametrize("error_handling", [True, False], ids=["eh", "no-eh"])
def test_pull_from_an_exporter_in_another_process(error_handling):
    # with error handling off UCX reads the exporter's pool over CMA: this is that path across processes
    async def main():
        lease = _lease()
        mode = "eh" if error_handling else "no-eh"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _EXPORTER, "bfloat16", lease, json.dumps(SRC_IDS[:4]), os.path.dirname(__file__), mode,
            stdout=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        layout = _layout("bfloat16")
        config = UCXConfig(endpoint_error_handling=error_handling)
        importer = UCXTransport(_pool(layout, 2), layout, timeout_s=10.0, config=config)
        try:
            params = HandoffParams.from_dict(await _next_message(proc, 30))
            assert params.lease_id == lease and params.block_hashes == (7, 8, 9)
            await importer.pull(params, DST_IDS[:4])
            expected = _pool(layout, 1).kv_pool[SRC_IDS[:4]]
            assert torch.equal(importer.pool.kv_pool[DST_IDS[:4]].view(torch.uint8), expected.view(torch.uint8))
            assert await _next_message(proc, 10) == {"released": lease}
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        finally:
            await importer.close()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    asyncio.run(main())


def test_env_defaults_yield_to_the_environment(monkeypatch):
    config = UCXConfig()
    for name in config.env:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    applied = apply_ucx_env(config)
    assert applied["UCX_TLS"] == "tcp,self"
    assert applied["UCX_RNDV_SCHEME"] == os.environ["UCX_RNDV_SCHEME"] == "put_zcopy"
    assert applied["UCXPY_ENABLE_PYTHON_FUTURE"] == "1"
    cuda_like = UCXConfig.for_pool(KVPoolIO(torch.zeros(1, 4, device="meta")), endpoint_error_handling=False)
    assert "UCX_TLS" not in cuda_like.env and not cuda_like.endpoint_error_handling
    assert UCXConfig().endpoint_error_handling  # safe by default: a dying peer raises instead of aborting us
