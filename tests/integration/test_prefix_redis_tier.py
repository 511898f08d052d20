"""The Redis tier as a cross-instance prefix cache, on real engines and a real Redis server: one engine's
prefill publishes its blocks, another pulls the prompt's prefix into its prefix cache (bit-exact,
checksummed) and hits it; a corrupt block or a stopped Redis pulls nothing and the prompt is recomputed,
counted by the worker."""

from __future__ import annotations

import asyncio

import pytest
import redis

from pdserve.engine import AsyncLLMEngine, GenerationRequest, LLMEngine
from pdserve.engine.handoff import KVExporter, engine_layout, engine_pool
from pdserve.engine.prefix_pull import PrefixPuller
from pdserve.kvcache.transports.redis import RedisTransport, block_key
from pdserve.models.tiny import ensure_tiny_checkpoint
from pdserve.prefix_hash import prompt_block_hashes
from pdserve.sampling_params import SamplingParams

NUM_BLOCKS = 48
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def _prompt(seed: int, n: int) -> tuple[int, ...]:
    """A prompt of the tiny model's ids (vocab 384) of its own: no other test's keys in Redis."""
    return tuple((seed * 131 + i * 17 + i * i) % 384 for i in range(n))


def _engine(tiny_dir) -> AsyncLLMEngine:
    """As a replica builds it (WorkerConfig: the float16 KV cache on CPU), so that its Redis keys are the replicas'."""
    from pdserve.services.worker import WorkerConfig

    return AsyncLLMEngine(LLMEngine(WorkerConfig(model=str(tiny_dir), num_blocks=NUM_BLOCKS).engine_config()))


def _transport(engine, url, release=None) -> RedisTransport:
    return RedisTransport(engine_pool(engine), engine_layout(engine), release, url=url, socket_timeout_s=2.0)


async def _publish(engine, url, prompt, request_id: str = "pub") -> None:
    """What a prefill replica does: prefill, then copy the prompt's blocks into Redis and release them."""
    request = GenerationRequest(request_id, prompt, GREEDY, prefill_only=True)
    (delta,) = [d async for d in engine.generate(request)]
    await KVExporter(engine, _transport(engine, url, engine.release_lease_quietly)).export(delta.kv_handoff)


async def _generate(engine, request_id, prompt):
    deltas = [d async for d in engine.generate(GenerationRequest(request_id, prompt, GREEDY))]
    return [t for d in deltas for t in d.token_ids], deltas[0].num_cached_tokens


def _block_bytes(engine, block_hash) -> bytes:
    block_id = engine.engine.block_manager.hash_to_block[block_hash]
    (view,) = engine_pool(engine).read_blocks([block_id])
    return bytes(view)


def test_pulled_prefix_is_bit_exact_hit_and_decodes_as_recomputed(tiny_dir, redis_server):
    prompt = _prompt(1, 90)  # 90 tokens: 5 full blocks of 16 can be hit
    system = prompt[:32]

    async def main():
        a, b, ref = _engine(tiny_dir), _engine(tiny_dir), _engine(tiny_dir)
        await _publish(a, redis_server.url, prompt)
        expected, _ = await _generate(ref, "ref", prompt)
        puller = PrefixPuller(b, _transport(b, redis_server.url))
        # b already holds the first two blocks (a shared system prompt): it pulls only the other three
        await _generate(b, "warm", system + (7,) * 5)
        hashes = prompt_block_hashes(prompt, 16)
        pull = await puller.pull(prompt, len(hashes))
        assert (pull.failure, pull.num_local_blocks, pull.num_pulled_blocks) == (None, 2, 3)
        for h in hashes[2:]:
            assert _block_bytes(b, h) == _block_bytes(a, h)  # the pulled blocks: bit-exact copies of a's
        tokens, cached = await _generate(b, "hit", prompt)
        assert cached == 5 * 16 and tokens == expected
        assert pull.hit_sources(cached) == {"local": 32, "redis": 48}
        assert b.engine.block_manager.num_free_blocks == NUM_BLOCKS  # nothing leaked
        for e in (a, b, ref):
            await e.close()

    asyncio.run(main())


def test_a_pull_cancelled_as_its_blocks_wait_for_the_engine_leaves_no_lease(tiny_dir, redis_server):
    """The request goes (its client left) just as its pulled blocks wait to enter the prefix cache, while a
    step holds the engine: they still enter it, and no lease is left to expire."""
    prompt = _prompt(3, 60)

    async def main():
        a, b = _engine(tiny_dir), _engine(tiny_dir)
        await _publish(a, redis_server.url, prompt)
        pulled = asyncio.Event()

        class StepStartsAsThePullEnds(RedisTransport):
            async def pull_prefix(self, *args):
                await super().pull_prefix(*args)
                await b._lock.acquire()
                pulled.set()

        transport = StepStartsAsThePullEnds(engine_pool(b), engine_layout(b), None, url=redis_server.url,
                                            socket_timeout_s=2.0)
        hashes = prompt_block_hashes(prompt, 16)
        pulling = asyncio.create_task(PrefixPuller(b, transport).pull(prompt, len(hashes)))
        await pulled.wait()
        pulling.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pulling
        assert b.engine.leases.leases  # the filled lease waits for the engine
        b._lock.release()
        await asyncio.sleep(0.05)
        bm = b.engine.block_manager
        assert not b.engine.leases.leases and all(h in bm.hash_to_block for h in hashes)
        assert bm.num_free_blocks == NUM_BLOCKS  # cached, not held
        _, cached = await _generate(b, "hit", prompt)
        assert cached == len(hashes) * 16
        for e in (a, b):
            await e.close()

    asyncio.run(main())


def test_a_corrupt_block_is_refused_and_the_prompt_recomputed(tiny_dir, redis_server):
    prompt = _prompt(2, 60)  # 3 full blocks of 16 can be hit

    async def main():
        a, b = _engine(tiny_dir), _engine(tiny_dir)
        await _publish(a, redis_server.url, prompt)
        hashes = prompt_block_hashes(prompt, 16)
        client = redis.Redis.from_url(redis_server.url)
        key = block_key("pdkv", engine_layout(b).layout_hash, hashes[1])
        value = bytearray(client.get(key))
        value[-1] ^= 0x01  # one bit of the payload: only the checksum can tell
        client.set(key, bytes(value), ex=60)
        pull = await PrefixPuller(b, _transport(b, redis_server.url)).pull(prompt, len(hashes))
        assert (pull.failure, pull.num_pulled_blocks) == ("corrupt_payload", 0)
        assert "checksum" in pull.error
        bm = b.engine.block_manager
        assert not any(h in bm.hash_to_block for h in hashes)  # none of the batch entered the cache
        assert bm.num_free_blocks == NUM_BLOCKS
        _, cached = await _generate(b, "recompute", prompt)
        assert cached == 0
        for e in (a, b):
            await e.close()

    asyncio.run(main())


def test_redis_down_the_decode_worker_recomputes_and_counts_it(tiny_dir, redis_server):
    """The decode deployment's own code path (no Serve): a local prefill told to pull from a stopped Redis."""
    if redis_server.is_external:
        pytest.skip("external REDIS_URL")
    from pdserve.api.contract import WorkerRequest
    from pdserve.services.decode.app import DecodeDeployment
    from pdserve.services.worker import WorkerConfig

    prompt = _prompt(3, 70)

    async def main():
        a = _engine(tiny_dir)
        await _publish(a, redis_server.url, prompt)
        config = WorkerConfig(model=str(tiny_dir), transport="redis", redis_url=redis_server.url, num_blocks=NUM_BLOCKS,
                              num_cpus=1).model_dump()
        decode = DecodeDeployment.func_or_class(config)
        metrics = decode.telemetry.metrics
        request = WorkerRequest("r1", prompt, GREEDY, prefix_pull_blocks=4)
        redis_server.stop()
        try:
            events = [e async for e in decode.generate(request)]
        finally:
            redis_server.start()
        assert events[-1].finished and sum(len(e.token_ids) for e in events) == GREEDY.max_tokens
        assert events[0].num_cached_tokens == 0  # recomputed
        text = metrics.render().decode()
        assert 'reason="prefix_transfer_failed"' in text
        assert _sample(text, "pdserve_fallbacks_total", reason="prefix_transfer_failed") == 1
        # with Redis back (empty: no persistence), a prompt this pool never saw, published: pulled
        other = _prompt(4, 70)
        await _publish(a, redis_server.url, other, "pub-other")
        events = [e async for e in decode.generate(WorkerRequest("r2", other, GREEDY, prefix_pull_blocks=4))]
        assert events[0].num_cached_tokens == 4 * 16
        assert _sample(metrics.render().decode(), "pdserve_prefix_cache_hit_tokens_total", source="redis") == 64
        await decode.engine.close()
        await a.close()

    asyncio.run(main())


def _sample(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    found = [s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]
