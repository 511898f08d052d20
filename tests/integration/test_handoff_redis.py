"""Prefill -> Redis -> decode through two real engines, and Redis failing mid-run."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import AsyncLLMEngine, GenerationRequest, LLMEngine
from pdserve.engine.handoff import KVExporter, KVImporter, engine_layout, engine_pool
from pdserve.kvcache.transports.base import KVTransferError
from pdserve.kvcache.transports.redis import RedisTransport
from pdserve.models.tiny import ensure_tiny_checkpoint
from pdserve.sampling_params import SamplingParams

NUM_BLOCKS = 32
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT = tuple(range(60, 101))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def _engine(tiny_dir) -> AsyncLLMEngine:
    cfg = EngineConfig(model=str(tiny_dir), device="cpu", dtype="float32", cache=CacheConfig(num_blocks=NUM_BLOCKS))
    return AsyncLLMEngine(LLMEngine(cfg))


def _ends(a, b, url):
    src = RedisTransport(engine_pool(a), engine_layout(a), a.release_lease_quietly, url=url, socket_timeout_s=2.0)
    dst = RedisTransport(engine_pool(b), engine_layout(b), url=url, socket_timeout_s=2.0)
    return KVExporter(a, src), KVImporter(b, dst)


async def _prefill(engine, request_id):
    (delta,) = [d async for d in engine.generate(GenerationRequest(request_id, PROMPT, GREEDY, prefill_only=True))]
    return delta.token_ids[0], delta.kv_handoff


def _free(engine) -> int:
    return engine.engine.block_manager.num_free_blocks


def test_redis_handoff_matches_plain_generation(tiny_dir, redis_server):
    async def main():
        a, b, ref = _engine(tiny_dir), _engine(tiny_dir), _engine(tiny_dir)
        exporter, importer = _ends(a, b, redis_server.url)
        expected = [t async for d in ref.generate(GenerationRequest("ref", PROMPT, GREEDY)) for t in d.token_ids]
        first, handoff = await _prefill(a, "p")
        params = await exporter.export(handoff)
        await exporter.transport.settle_releases()
        assert _free(a) == NUM_BLOCKS  # the blocks live in Redis now; the prefill lease is released
        result = await importer.import_kv(params)
        assert result.ok, result.error
        request = GenerationRequest("d", PROMPT, GREEDY, adopt_lease_id=result.lease_id, first_token_id=first)
        rest = [t async for d in b.generate(request) for t in d.token_ids]
        assert [first, *rest] == expected
        assert _free(b) == NUM_BLOCKS
        for e in (a, b, ref):
            await e.close()

    asyncio.run(main())


def test_redis_down_mid_run_falls_back_without_leaks(tiny_dir, redis_server):
    if redis_server.is_external:
        pytest.skip("external REDIS_URL")

    async def main():
        a, b = _engine(tiny_dir), _engine(tiny_dir)
        exporter, importer = _ends(a, b, redis_server.url)
        _, handoff = await _prefill(a, "p1")
        params = await exporter.export(handoff)
        redis_server.stop()
        try:
            # decode side: a clear error, counted as a fallback, reserved blocks released, no hang
            result = await asyncio.wait_for(importer.import_kv(params), 15)
            assert result.fallback_reason == "transfer_failed" and "unreachable" in result.error
            assert _free(b) == NUM_BLOCKS and importer.fallbacks["transfer_failed"] == 1
            # prefill side: export fails, its lease is released
            _, handoff2 = await _prefill(a, "p2")
            with pytest.raises(KVTransferError):
                await asyncio.wait_for(exporter.export(handoff2), 15)
            assert _free(a) == NUM_BLOCKS
        finally:
            redis_server.start()
        _, handoff3 = await _prefill(a, "p3")
        result = await importer.import_kv(await exporter.export(handoff3))
        assert result.ok
        await b.release_lease(result.lease_id)
        assert _free(a) == _free(b) == NUM_BLOCKS
        for e in (a, b):
            await e.close()

    asyncio.run(main())
