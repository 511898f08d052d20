"""The Redis tier over TLS (rediss://) and AUTH against a real TLS-enabled redis-server (see redis_tls.py):
KV blocks round-trip through the redis transport, the kvstore settings are applied and read back, the
health probe sees it; a client that does not trust the server's CA, speaks plain TCP, or has no password
gets nothing."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest
import redis
import torch

from pdserve.kvcache.layout import KVLayout
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports import KVTransferError
from pdserve.kvcache.transports.redis import RedisTransport
from pdserve.runtime.redis_health import RedisProbe, apply_settings
from pdserve.runtime.redis_server import RedisServer, generate_password

pytest.importorskip("cryptography")
_spec = importlib.util.spec_from_file_location("redis_tls", Path(__file__).with_name("redis_tls.py"))
redis_tls = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("redis_tls", redis_tls)
_spec.loader.exec_module(redis_tls)

LAYOUT = KVLayout("tls-test", "float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    binary = redis_tls.tls_server_binary()
    workdir = tmp_path_factory.mktemp("redis-tls")
    server = RedisServer(binary, workdir, password=generate_password(),
                         settings={"maxmemory-policy": "allkeys-lru"}, tls=redis_tls.make_certs(workdir / "certs"))
    server.start()
    yield server
    server.stop()


def _pool(seed: int) -> KVPoolIO:
    gen = torch.Generator().manual_seed(seed)
    return KVPoolIO(torch.randn((8, 2, 2, 4, 2, 8), generator=gen))


def test_the_server_speaks_tls_only_and_the_url_says_so(tls_server):
    assert tls_server.url.startswith("rediss://:") and "ssl_ca_certs=" in tls_server.url
    with tls_server.client() as client:
        assert client.ping()
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert client.config_get("tls-port") == {"tls-port": str(tls_server.port)}
    plain = redis.Redis(host="127.0.0.1", port=tls_server.port, password=tls_server.password, socket_timeout=2)
    with pytest.raises(redis.ConnectionError):
        plain.ping()


def test_a_client_that_does_not_trust_the_ca_is_refused(tls_server, tmp_path):
    other = redis_tls.make_certs(tmp_path, "other")
    url = tls_server.url.split("?")[0] + f"?ssl_ca_certs={other.ca_file}"
    with pytest.raises(redis.ConnectionError, match="(?i)certificate"):
        redis.Redis.from_url(url, socket_timeout=2).ping()


def test_a_client_without_the_password_is_refused(tls_server):
    url = tls_server.url.replace(f":{tls_server.password}@", "")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(url, socket_timeout=2).ping()


def test_kv_blocks_round_trip_over_tls(tls_server):
    async def main():
        source, sink = _pool(1), _pool(2)
        exporter = RedisTransport(source, LAYOUT, url=tls_server.url, ttl_s=60)
        importer = RedisTransport(sink, LAYOUT, url=tls_server.url, ttl_s=60)
        await exporter.start()
        params = await exporter.export("a" * 32, [1, 2, 5], [11, 12], 10)
        await importer.pull(params, [0, 3, 4])
        assert torch.equal(sink.kv_pool[[0, 3, 4]], source.kv_pool[[1, 2, 5]])
        assert exporter.stats.blocks_written == 3 and importer.stats.blocks_read == 3
        no_auth = RedisTransport(sink, LAYOUT, url=tls_server.url.replace(f":{tls_server.password}@", ""))
        with pytest.raises(KVTransferError, match="authentication"):
            await no_auth.start()
        for transport in (exporter, importer, no_auth):
            await transport.close()

    asyncio.run(main())


def test_settings_and_health_over_tls(tls_server):
    async def main():
        import redis.asyncio as aioredis

        client = aioredis.from_url(tls_server.url, socket_timeout=2)
        await apply_settings(client, {"maxmemory": "33554432", "maxmemory-policy": "allkeys-lru"}, "tls-test")
        assert await client.config_get("maxmemory") == {"maxmemory": "33554432"}
        await client.aclose()
        probe = RedisProbe(tls_server.url)
        assert await probe.probe_once() and probe.up is True
        await probe.close()

    asyncio.run(main())
