"""KV-aware routing and the Redis tier through the real Serve app, with a real HTTP client:

- colocated, two decode replicas, `kv_aware`: every later turn of a chat lands where its history is
  cached (usage.prompt_tokens_details.cached_tokens covers it), where round robin would alternate;
- disaggregated over Redis, two prefill replicas placed round robin: the replica that never saw a
  prompt pulls its prefix from the Redis tier, found by the router through the kvstore deployment.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest

pytest.importorskip("ray")
try:
    import httpx
except ImportError:  # the openai client here ships on httpx2
    import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.app import SystemConfig, build_system

BS = 16


def _complete(url: str, prompt: list[int], max_tokens: int = 4) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def _samples(url: str, name: str, **labels: str) -> list[float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return [s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def _pulled(url: str) -> float:
    """Prefix tokens prefill replicas took from the Redis tier, once every prefill replica is in /metrics."""
    for _ in range(20):
        pulled = _samples(url, "pdserve_prefix_cache_hit_tokens_total", role="prefill", source="redis")
        if len(pulled) == 2:
            return sum(pulled)
        time.sleep(0.5)
    return 0.0


async def _stream(url: str, prompt: list[int]):
    from pdserve.loadtest.client import RequestResult, new_client, send
    from pdserve.loadtest.workloads import RequestSpec

    async with new_client(1) as client:
        result = RequestResult(0, len(prompt), 4, 0.0)
        return await send(client, url, "tiny", RequestSpec(tuple(prompt), 4), result, time.perf_counter())


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 380) for _ in range(n)]


def _deploy(serve, name: str, config: SystemConfig) -> str:
    serve.run(build_system(config), name=name, route_prefix=f"/{name}")
    return f"http://127.0.0.1:{serve.http_port}/{name}"


def test_kv_aware_sends_every_turn_to_its_history(ray_serve):
    config = SystemConfig(mode="colocated", decode={"num_replicas": 2, "num_cpus": 0, "num_blocks": 256},
                          router={"num_cpus": 0, "placement": {"policy": "kv_aware"}})
    url = _deploy(ray_serve, "pdserve-kv-aware", config)
    rng = random.Random(0)
    try:
        deadline = time.monotonic() + 60
        # until the router's poller knows both replicas (on a busy machine its first discovery can take
        # seconds; placed before it, a turn lands wherever Serve sends it)
        while httpx.get(f"{url}/health", timeout=30).json().get("replicas", {}).get("decode") != 2:
            assert time.monotonic() < deadline, "the router never saw both decode replicas"
            time.sleep(0.2)
        while True:  # until placement runs on stats and the prefix index
            history = _tokens(rng, 100)
            _complete(url, history)
            time.sleep(0.3)
            if _cached(_complete(url, history + _tokens(rng, 20))) >= 96:
                break
            assert time.monotonic() < deadline, "the router never placed a turn where its history was"
        chats = [_tokens(rng, 60 + 20 * i) for i in range(6)]
        for turn in range(3):
            for i, history in enumerate(chats):
                reply = _complete(url, history)
                if turn:  # the previous turn's prompt, in full blocks
                    assert _cached(reply) >= (len(history) - 41) // BS * BS, (turn, i)
                chats[i] = history + _tokens(rng, 40)
        assert sum(_samples(url, "pdserve_prefix_cache_hit_tokens_total", role="decode", source="local")) > 0
        # the load generator reads the same figure from the streamed usage chunk
        streamed = asyncio.run(_stream(url, chats[0]))
        assert streamed.ok and streamed.cached_tokens >= (len(chats[0]) - 41) // BS * BS
    finally:
        ray_serve.delete("pdserve-kv-aware")


def test_a_prefill_replica_pulls_a_prefix_from_the_redis_tier_found_by_the_kvstore(ray_serve, redis_server):
    app = "pdserve-redis-tier"
    config = SystemConfig(mode="disaggregated", transport="redis", redis_url=redis_server.url,
                          prefill={"num_replicas": 2, "num_cpus": 0, "num_blocks": 128},
                          decode={"num_cpus": 0, "num_blocks": 256},
                          router={"num_cpus": 0, "placement": {"policy": "round_robin"}})
    url = _deploy(ray_serve, app, config)
    rng = random.Random(1)
    try:
        deadline = time.monotonic() + 60
        cached = []
        while not _pulled(url):
            # one shared prefix, alternately on each prefill replica: the second to see it pulls from Redis
            system = _tokens(rng, 96)
            cached += [_cached(_complete(url, system + _tokens(rng, 8))) for _ in range(4)]
            assert time.monotonic() < deadline, "no prefill replica ever pulled from the Redis tier"
        assert max(cached) >= 96  # the shared prefix, in full blocks, reported to clients
        from ray import serve

        stats = serve.get_deployment_handle("kvstore", app).stats.remote().result(timeout_s=30)
        assert stats["lookups"] > 0 and stats["hit_blocks"] > 0  # the router's lookups reached it
        assert not _samples(url, "pdserve_fallbacks_total", reason="prefix_transfer_failed")
    finally:
        ray_serve.delete(app)
