"""KV handoff between engines of different tensor-parallel degrees, in process over the local transport:
prefill TP=p hands a prompt's KV to decode TP=d and the greedy output equals a TP=1 engine's, for p, d in
{1, 2} and for uneven head splits (tiny: 4 KV heads, so TP=3 holds 2, 1 and 1), with the KV pool in the
model dtype and quantized (int8, fp8: values and per-head scales split by head). The blocks a TP replica
exports, parts included, are the whole model's: equal to what a TP=1 engine pools for the same prompt."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from pdserve.bench.tp import engine_config
from pdserve.engine import AsyncLLMEngine, GenerationRequest, LLMEngine
from pdserve.engine.handoff import KVExporter, KVImporter, engine_layout, engine_pool
from pdserve.kvcache.quant import value_scale_views
from pdserve.kvcache.transports.local import LocalHub, LocalTransport
from pdserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPT = tuple(range(100, 157))  # 57 tokens: 3 full blocks of 16 and a partial one
NUM_BLOCKS = 32


def _config(tp: int, kv_cache_dtype: str = "auto"):
    config = engine_config("tiny", tp, num_blocks=NUM_BLOCKS)
    return dataclasses.replace(config, cache=dataclasses.replace(config.cache, kv_cache_dtype=kv_cache_dtype))


def _engine(tp: int, kv_cache_dtype: str = "auto") -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine(_config(tp, kv_cache_dtype)))


async def _tokens(engine: AsyncLLMEngine, request: GenerationRequest) -> list[int]:
    return [t async for d in engine.generate(request) for t in d.token_ids]


async def _reference(kv_cache_dtype: str) -> list[int]:
    engine = _engine(1, kv_cache_dtype)
    try:
        return await _tokens(engine, GenerationRequest("ref", PROMPT, GREEDY))
    finally:
        await engine.close()


@pytest.fixture(scope="module")
def expected() -> list[int]:
    return asyncio.run(_reference("auto"))


async def _hand_over(prefill_tp: int, decode_tp: int, kv_cache_dtype: str = "auto") -> list[int]:
    """Prefill at one degree, pull into an engine at another, decode there: the greedy tokens."""
    prefill, decode = _engine(prefill_tp, kv_cache_dtype), _engine(decode_tp, kv_cache_dtype)
    try:
        assert engine_layout(prefill).layout_hash == engine_layout(decode).layout_hash
        hub = LocalHub()
        exporter = KVExporter(prefill, LocalTransport(engine_pool(prefill), engine_layout(prefill),
                                                      prefill.release_lease_quietly, hub=hub))
        importer = KVImporter(decode, LocalTransport(engine_pool(decode), engine_layout(decode), hub=hub))
        (delta,) = [d async for d in prefill.generate(GenerationRequest("p", PROMPT, GREEDY, prefill_only=True))]
        result = await importer.import_kv(await exporter.export(delta.kv_handoff))
        assert result.ok, (result.fallback_reason, result.error)
        rest = await _tokens(decode, GenerationRequest("d", PROMPT, GREEDY, adopt_lease_id=result.lease_id,
                                                       first_token_id=delta.token_ids[0]))
        for engine, tp in ((prefill, prefill_tp), (decode, decode_tp)):
            free = engine.engine.block_manager.num_free_blocks
            assert free == NUM_BLOCKS, f"TP={tp} engine holds {NUM_BLOCKS - free} blocks after the request"
        if prefill_tp > 1:
            assert prefill.engine.sharded_kv.num_gathered == 4
        if decode_tp > 1:
            assert decode.engine.sharded_kv.num_scattered == 4
        return [delta.token_ids[0], *rest]
    finally:
        for engine in (prefill, decode):
            await engine.close()
            engine.engine.shutdown()


@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (1, 2), (2, 1), (2, 2), (3, 2), (2, 3)])
def test_handoff_across_tp_degrees_matches_tp1_greedy(prefill_tp, decode_tp, expected):
    assert asyncio.run(_hand_over(prefill_tp, decode_tp)) == expected


@pytest.mark.parametrize("kv_cache_dtype,prefill_tp,decode_tp", [("int8", 2, 1), ("int8", 1, 3), ("fp8_e4m3", 3, 2)])
def test_quantized_kv_hands_over_across_tp_degrees_as_tp1_quantized(kv_cache_dtype, prefill_tp, decode_tp):
    assert asyncio.run(_hand_over(prefill_tp, decode_tp, kv_cache_dtype)) == asyncio.run(_reference(kv_cache_dtype))


def _prefill_blocks(tp: int, kv_cache_dtype: str) -> tuple[torch.Tensor, int]:
    """The exported blocks of a prompt prefilled in parts of one block each, in prompt order (pool rows); and
    the number of parts."""
    engine = LLMEngine(_config(tp, kv_cache_dtype))
    try:
        engine.add_request(GenerationRequest("p", PROMPT, GREEDY, prefill_only=True, kv_part_tokens=16))
        block_ids, parts = [], 0
        while engine.has_unfinished():
            for d in engine.step():
                if d.kv_part is not None:
                    block_ids += d.kv_part.block_ids
                    parts += 1
                if d.kv_handoff is not None:
                    block_ids += d.kv_handoff.block_ids[d.kv_handoff.num_parted_blocks:]
        return engine.handoff_pool[block_ids].clone(), parts
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_tp_replicas_exported_blocks_and_parts_equal_a_tp1_pools(kv_cache_dtype):
    reference, parts = _prefill_blocks(1, kv_cache_dtype)
    assert parts == 3 and reference.shape[0] == 4
    for tp in (2, 3):
        got, got_parts = _prefill_blocks(tp, kv_cache_dtype)
        assert got_parts == parts and got.shape == reference.shape
        if kv_cache_dtype == "auto":
            torch.testing.assert_close(got, reference, rtol=0, atol=1e-5)
            continue
        # int8 values may round the other way where fp32 summation order moved K or V by ~1e-6
        views = [value_scale_views(rows, 4, 16, 4, 32, kv_cache_dtype) for rows in (got, reference)]
        (got_values, got_scales), (ref_values, ref_scales) = views
        assert (got_values.to(torch.int16) - ref_values.to(torch.int16)).abs().max().item() <= 1
        torch.testing.assert_close(got_scales, ref_scales, rtol=1e-3, atol=0)


def test_through_redis_handoff_and_prefix_pulls_into_tp_replicas_match_tp1(redis_server, expected):
    """Prefill TP=2 stores the prompt's blocks in Redis; decode TP=2 adopts them (scattered to its ranks); a
    third engine at TP=2 pulls the prompt's full blocks as a cached prefix and computes only the rest."""
    from pdserve.engine.prefix_pull import PrefixPuller
    from pdserve.kvcache.transports.redis import RedisTransport

    def transport(engine, release=None):
        return RedisTransport(engine_pool(engine), engine_layout(engine), release, url=redis_server.url,
                              socket_timeout_s=5.0)

    async def main():
        prefill, decode, puller_engine = _engine(2), _engine(2), _engine(2)
        try:
            exporter = KVExporter(prefill, transport(prefill, prefill.release_lease_quietly))
            importer = KVImporter(decode, transport(decode))
            (delta,) = [d async for d in prefill.generate(GenerationRequest("p", PROMPT, GREEDY, prefill_only=True))]
            result = await importer.import_kv(await exporter.export(delta.kv_handoff))
            assert result.ok, (result.fallback_reason, result.error)
            rest = await _tokens(decode, GenerationRequest("d", PROMPT, GREEDY, adopt_lease_id=result.lease_id,
                                                           first_token_id=delta.token_ids[0]))
            assert [delta.token_ids[0], *rest] == expected
            pull = await PrefixPuller(puller_engine, transport(puller_engine)).pull(PROMPT, 3)
            assert (pull.failure, pull.num_pulled_blocks) == (None, 3), pull.error
            assert puller_engine.engine.sharded_kv.num_scattered == 3
            deltas = [d async for d in puller_engine.generate(GenerationRequest("c", PROMPT, GREEDY))]
            assert deltas[0].num_cached_tokens == 48  # the 3 pulled blocks: only the last 9 tokens computed
            assert [t for d in deltas for t in d.token_ids] == expected
        finally:
            for engine in (prefill, decode, puller_engine):
                await engine.close()
                engine.engine.shutdown()

    asyncio.run(main())
