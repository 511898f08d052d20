"""Prefill on one engine, hand the KV over the local transport, decode on another engine."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import AsyncLLMEngine, GenerationRequest, LLMEngine
from pdserve.engine.handoff import KVExporter, KVImporter, engine_layout, engine_pool
from pdserve.kvcache.transports.local import LocalHub, LocalTransport
from pdserve.models.tiny import ensure_tiny_checkpoint
from pdserve.sampling_params import SamplingParams

NUM_BLOCKS = 32
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = tuple(range(40, 77))  # 37 tokens: 2 full blocks and a partial one


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def _engine(tiny_dir) -> AsyncLLMEngine:
    cfg = EngineConfig(model=str(tiny_dir), device="cpu", dtype="float32", cache=CacheConfig(num_blocks=NUM_BLOCKS))
    return AsyncLLMEngine(LLMEngine(cfg))


def _pair(engine_a, engine_b):
    hub = LocalHub()
    export_side = LocalTransport(engine_pool(engine_a), engine_layout(engine_a), engine_a.release_lease_quietly, hub=hub)
    import_side = LocalTransport(engine_pool(engine_b), engine_layout(engine_b), hub=hub)
    return KVExporter(engine_a, export_side), KVImporter(engine_b, import_side)


async def _collect(engine, request) -> list[int]:
    return [t async for d in engine.generate(request) for t in d.token_ids]


async def _prefill(engine, request_id: str):
    deltas = [d async for d in engine.generate(GenerationRequest(request_id, PROMPT, GREEDY, prefill_only=True))]
    (delta,) = deltas
    return delta.token_ids[0], delta.kv_handoff


def _free(engine) -> int:
    return engine.engine.block_manager.num_free_blocks


def test_handoff_between_engines_matches_plain_generation(tiny_dir):
    async def main():
        a, b, ref = _engine(tiny_dir), _engine(tiny_dir), _engine(tiny_dir)
        exporter, importer = _pair(a, b)
        expected = await _collect(ref, GenerationRequest("ref", PROMPT, GREEDY))
        first, handoff = await _prefill(a, "p")
        params = await exporter.export(handoff)
        result = await importer.import_kv(params)
        assert result.ok and not importer.fallbacks
        # max_tokens counts the adopted first token, as in a single-engine run
        rest = await _collect(b, GenerationRequest("d", PROMPT, GREEDY, adopt_lease_id=result.lease_id,
                                                   first_token_id=first))
        assert [first, *rest] == expected
        assert _free(a) == _free(b) == NUM_BLOCKS  # source lease released after the pull
        for e in (a, b, ref):
            await e.close()

    asyncio.run(main())


def test_layout_mismatch_falls_back_and_is_counted(tiny_dir):
    async def main():
        a, b = _engine(tiny_dir), _engine(tiny_dir)
        exporter, importer = _pair(a, b)
        _, handoff = await _prefill(a, "p")
        params = dataclasses.replace(await exporter.export(handoff), layout_hash=1234)
        result = await importer.import_kv(params)
        assert not result.ok and result.fallback_reason == "layout_mismatch"
        assert importer.fallbacks == {"layout_mismatch": 1}
        assert _free(b) == NUM_BLOCKS
        await a.release_lease(handoff.lease_id)
        assert _free(a) == NUM_BLOCKS
        for e in (a, b):
            await e.close()

    asyncio.run(main())


def test_abort_before_transfer_frees_blocks_and_a_late_pull_falls_back(tiny_dir):
    async def main():
        a, b = _engine(tiny_dir), _engine(tiny_dir)
        exporter, importer = _pair(a, b)
        _, handoff = await _prefill(a, "p")
        params = await exporter.export(handoff)
        assert exporter.transport.forget(handoff.lease_id)
        assert await a.release_lease(handoff.lease_id)
        assert _free(a) == NUM_BLOCKS
        result = await importer.import_kv(params)
        assert result.fallback_reason == "transfer_failed" and "lease" in result.error
        assert _free(b) == NUM_BLOCKS
        for e in (a, b):
            await e.close()

    asyncio.run(main())


def test_no_capacity_on_decode_falls_back(tiny_dir):
    async def main():
        a, b = _engine(tiny_dir), _engine(tiny_dir)
        exporter, importer = _pair(a, b)
        _, handoff = await _prefill(a, "p")
        params = await exporter.export(handoff)
        hog = await b.reserve_kv(16 * (NUM_BLOCKS - 1))
        result = await importer.import_kv(params)
        assert result.fallback_reason == "no_kv_capacity"
        await b.release_lease(hog.lease_id)
        await a.release_lease(handoff.lease_id)
        assert _free(a) == _free(b) == NUM_BLOCKS
        for e in (a, b):
            await e.close()

    asyncio.run(main())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_local_transport_round_trip_is_bit_exact(dtype):
    import torch

    from pdserve.kvcache.layout import KVLayout
    from pdserve.kvcache.pool import KVPoolIO

    layout = KVLayout("m", dtype, 2, 2, 16, 16)
    shape = (8, 2, 2, 16, 2, 16)
    src = KVPoolIO(torch.randn(shape).to(getattr(torch, dtype)))
    dst = KVPoolIO(torch.zeros(shape, dtype=getattr(torch, dtype)))
    hub = LocalHub()
    released = []

    async def release(lease_id):
        released.append(lease_id)

    async def main():
        params = await LocalTransport(src, layout, release, hub=hub).export("L", [1, 4, 6], [11, 12], 40)
        await LocalTransport(dst, layout, hub=hub).pull(params, [7, 0, 3])

    asyncio.run(main())
    for s, d in ((1, 7), (4, 0), (6, 3)):
        assert torch.equal(src.block_tensor(s), dst.block_tensor(d))
    assert released == ["L"]
    assert not dst.kv_pool[[1, 2, 4, 5, 6]].any()
