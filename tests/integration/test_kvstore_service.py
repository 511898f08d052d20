"""The kvstore as a real Ray Serve app over a real Redis server."""

from __future__ import annotations

import pytest
import redis

ray = pytest.importorskip("ray")
from ray import serve  # noqa: E402

from pdserve.services.kvstore.app import build_app  # noqa: E402
from pdserve.services.kvstore.config import KVStoreConfig  # noqa: E402
from pdserve.services.kvstore.store import block_key  # noqa: E402

LAYOUT = 0xABCDEF


@pytest.fixture(scope="module")
def kvstore(redis_server, ray_serve):
    config = KVStoreConfig(redis_url=redis_server.url, maxmemory_bytes=64 << 20, maxmemory_policy="allkeys-lru")
    handle = serve.run(build_app(config), name="kvstore-test", route_prefix=None)
    yield handle
    serve.delete("kvstore-test")


def test_longest_prefix_lookup_and_policy(kvstore, redis_server):
    client = redis.Redis.from_url(redis_server.url)
    chain = [11, 22, 33, 44]
    for h in chain[:2] + chain[3:]:  # a hole at index 2
        client.set(block_key("pdkv", LAYOUT, h), b"x", ex=60)
    assert kvstore.lookup_prefix.remote(LAYOUT, chain).result() == 2
    assert kvstore.lookup_prefix.remote(LAYOUT + 1, chain).result() == 0  # other layout, other keys
    assert kvstore.lookup_prefix.remote(LAYOUT, []).result() == 0
    stats = kvstore.stats.remote().result()
    assert stats["healthy"] and stats["maxmemory_bytes"] == 64 << 20
    assert stats["maxmemory_policy"] == "allkeys-lru" and stats["hit_blocks"] >= 2
    assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"


def test_redis_down_degrades_to_misses_then_recovers(kvstore, redis_server):
    if not hasattr(redis_server, "stop"):
        pytest.skip("external REDIS_URL")
    client = redis.Redis.from_url(redis_server.url)
    client.set(block_key("pdkv", LAYOUT, 7), b"x", ex=60)
    redis_server.stop()
    try:
        assert kvstore.lookup_prefix.remote(LAYOUT, [7]).result(timeout_s=30) == 0
        stats = kvstore.stats.remote().result(timeout_s=30)
        assert not stats["healthy"] and "unavailable" in stats["error"]
    finally:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    client.set(block_key("pdkv", LAYOUT, 7), b"x", ex=60)
    assert kvstore.lookup_prefix.remote(LAYOUT, [7]).result(timeout_s=30) == 1
