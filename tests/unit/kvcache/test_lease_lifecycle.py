"""Exports end with their leases: the exporter forgets the export of a lease its engine let expire (well
before anyone asks), and a pull needs the handoff's secret (local transport; UCX in tests/integration)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from pdserve.config import CacheConfig, EngineConfig
from pdserve.api.contract import HandoffParams
from pdserve.engine import AsyncLLMEngine, GenerationRequest, LLMEngine
from pdserve.engine.handoff import KVExporter, KVImporter, engine_layout, engine_pool
from pdserve.kvcache.transports import KVTransferError
from pdserve.kvcache.transports.local import LocalHub, LocalTransport
from pdserve.models.tiny import ensure_tiny_checkpoint
from pdserve.sampling_params import SamplingParams

NUM_BLOCKS = 32
PROMPT = tuple(range(40, 77))
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def _engine(tiny_dir, lease_ttl_s: float = 30.0) -> AsyncLLMEngine:
    cfg = EngineConfig(model=str(tiny_dir), device="cpu", dtype="float32", lease_ttl_s=lease_ttl_s,
                       cache=CacheConfig(num_blocks=NUM_BLOCKS))
    return AsyncLLMEngine(LLMEngine(cfg))


async def _prefill(engine, request_id: str):
    (delta,) = [d async for d in engine.generate(GenerationRequest(request_id, PROMPT, GREEDY, prefill_only=True))]
    return delta.kv_handoff


async def _until(predicate, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_the_exporter_forgets_exports_whose_lease_expired(tiny_dir):
    async def main():
        a, b = _engine(tiny_dir, lease_ttl_s=0.3), _engine(tiny_dir)
        hub = LocalHub()
        source = LocalTransport(engine_pool(a), engine_layout(a), a.release_lease_quietly, hub=hub)
        exporter = KVExporter(a, source, sweep_interval_s=0.05)
        importer = KVImporter(b, LocalTransport(engine_pool(b), engine_layout(b), hub=hub))
        params = await exporter.export(await _prefill(a, "p"))
        assert source.exported_lease_ids() == [params.lease_id]
        await _until(lambda: not a.engine.leases.leases, 10.0)  # the engine expires the lease ...
        await _until(lambda: source.num_exports == 0, 10.0)  # ... and the exporter forgets its export
        result = await importer.import_kv(params)
        assert not result.ok and result.fallback_reason == "transfer_failed"
        assert a.engine.block_manager.num_free_blocks == NUM_BLOCKS
        assert b.engine.block_manager.num_free_blocks == NUM_BLOCKS
        await exporter.close()
        for e in (a, b):
            await e.close()

    asyncio.run(main())


def test_a_held_lease_is_not_forgotten_and_forget_is_per_transport(tiny_dir):
    async def main():
        a, b = _engine(tiny_dir), _engine(tiny_dir)
        hub = LocalHub()
        source = LocalTransport(engine_pool(a), engine_layout(a), a.release_lease_quietly, hub=hub)
        other = LocalTransport(engine_pool(b), engine_layout(b), hub=hub)
        exporter = KVExporter(a, source, sweep_interval_s=0.05)
        params = await exporter.export(await _prefill(a, "p"))
        await asyncio.sleep(0.3)  # several sweeps
        assert exporter.forget_expired() == 0 and source.exported_lease_ids() == [params.lease_id]
        assert not other.forget(params.lease_id) and other.exported_lease_ids() == []
        assert source.forget(params.lease_id) and not source.forget(params.lease_id)
        await exporter.close()
        await a.release_lease(params.lease_id)
        for e in (a, b):
            await e.close()

    asyncio.run(main())


@pytest.mark.parametrize("secret", ["", "0" * 32, "wrong"])
def test_a_local_pull_without_the_handoff_secret_is_refused(tiny_dir, secret):
    async def main():
        a, b = _engine(tiny_dir), _engine(tiny_dir)
        hub = LocalHub()
        source = LocalTransport(engine_pool(a), engine_layout(a), a.release_lease_quietly, hub=hub)
        sink = LocalTransport(engine_pool(b), engine_layout(b), hub=hub)
        params = await source.export(*_export_args(await _prefill(a, "p")))
        assert len(params.secret) == 32 and params.secret not in repr(params)
        before = b.engine.runner.kv_pool.clone()
        with pytest.raises(KVTransferError):
            await sink.pull(dataclasses.replace(params, secret=secret), list(range(len(params.block_ids))))
        assert b.engine.runner.kv_pool.equal(before)  # nothing landed
        assert source.exported_lease_ids() == [params.lease_id]  # the holder can still pull it
        await sink.pull(params, list(range(len(params.block_ids))))
        assert source.num_exports == 0
        for e in (a, b):
            await e.close()

    asyncio.run(main())


def _export_args(handoff):
    return handoff.lease_id, list(handoff.block_ids), list(handoff.block_hashes), handoff.num_tokens


def test_handoff_secret_round_trips_but_never_shows():
    params = HandoffParams("ucx", 1, "ab" * 16, 5, (1, 2), address="127.0.0.1", port=9, secret="s" * 32)
    assert HandoffParams.from_dict(params.to_dict()) == params
    assert "s" * 32 not in repr(params) and "s" * 32 not in str(params)



def test_a_stream_closed_mid_batch_frees_the_leases_it_never_handed_out(tiny_dir):
    """A prefill in KV parts yields a part a step; a reader away for a few steps (exporting a part) finds
    the rest waiting and takes them as one batch: parts and the handoff, each under its own lease. Closed
    after the batch's first delta (the router gone), the stream must free the leases of the deltas it never
    handed out, not leave them to the leases' 30 s expiry."""

    async def main():
        a = _engine(tiny_dir)
        request = GenerationRequest("parts", tuple(range(40, 140)), GREEDY, prefill_only=True, kv_part_tokens=16)
        stream = a.generate(request)
        read = [await anext(stream)]
        await _until(lambda: not a.engine.requests, 10.0)  # every other delta now waits in the stream
        read.append(await anext(stream))
        assert all(d.kv_part is not None for d in read)
        await stream.aclose()
        for delta in read:  # the leases this reader took
            await a.release_lease(delta.kv_part.lease_id)
        await _until(lambda: not a.engine.leases.leases, 2.0)
        assert a.engine.block_manager.num_free_blocks == NUM_BLOCKS
        await a.close()

    asyncio.run(main())
