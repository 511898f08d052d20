"""Whether a port can be bound the way Ray Serve's ingress binds it, and why not.

Serve's direct ingress binds without SO_REUSEADDR, so the connections a stopped server closed first
(TCP TIME_WAIT, up to 60 s on Linux) keep its port from being bound again, and Serve then marks the
port blocked for good. A port held by a listening program never frees by itself.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

FREE, TIME_WAIT, IN_USE = "free", "time_wait", "in_use"
TIME_WAIT_S = 60.0  # Linux's TCP TIME_WAIT


def _binds(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def _listened_on(host: str, port: int) -> bool:
    target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    try:
        socket.create_connection((target, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def port_state(host: str, port: int) -> str:
    """FREE; TIME_WAIT (no listener, only a closed server's connections hold it: it frees by itself); or
    IN_USE (a program listens on it)."""
    if _binds(host, port):
        return FREE
    return IN_USE if _listened_on(host, port) else TIME_WAIT


def holder(port: int) -> str | None:
    """'pid 1234 (python3)' of a process listening on `port`, from /proc (Linux; None where it cannot tell:
    another user's process, another network namespace)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir() if inodes else ():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return f"pid {proc.name} ({(proc / 'comm').read_text().strip()})"
        except OSError:
            continue
    return None


def wait_released(host: str, ports: list[int], timeout_s: float = 20.0, poll_s: float = 0.1) -> list[int]:
    """Waits until no program listens on `ports` (a stopped server's processes exit after it returns);
    the ports still listened on."""
    deadline = time.monotonic() + timeout_s
    while (held := [p for p in ports if port_state(host, p) == IN_USE]) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return held


def wait_bindable(host: str, ports: dict[str, int], stop: threading.Event, report: Callable[[str], None],
                  timeout_s: float = TIME_WAIT_S + 5, in_use_grace_s: float = 5.0,
                  poll_s: float = 0.5) -> dict[str, str]:
    """Waits while some of `ports` ({flag: port}) are held only by TIME_WAIT; {flag: state} of those that
    are still not free (empty: all free). A port a program listens on is returned after `in_use_grace_s`
    (a server stopped a moment ago may still be exiting)."""
    start = time.monotonic()
    told = set()
    while True:
        states = {flag: port_state(host, port) for flag, port in ports.items()}
        blocked = {flag: state for flag, state in states.items() if state != FREE}
        waited = time.monotonic() - start
        in_use_for_good = IN_USE in blocked.values() and waited >= in_use_grace_s
        if not blocked or in_use_for_good or waited >= timeout_s or stop.is_set():
            return blocked
        for flag in {f for f, state in blocked.items() if state == TIME_WAIT} - told:
            report(f"port {ports[flag]} ({flag}) still holds connections of a server that just stopped "
                   f"(TCP TIME_WAIT); waiting up to {timeout_s:.0f} s for it to free")
            told.add(flag)
        stop.wait(poll_s)


RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default min_worker_port..max_worker_port


def listen_port(host: str = "127.0.0.1") -> int:
    """A free port for a server that binds it later, as a user's fixed port would be: below the kernel's
    ephemeral range, where neither an outgoing connection nor a bind(0) listener (Ray starts hundreds of
    both) can take it between this check and the bind, and above Ray's worker ports. A bind(0) port is
    in that range, and Ray took one after the check once in CI."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    candidates = range(RAY_WORKER_PORTS.stop, low)
    for port in random.Random().sample(candidates, min(200, len(candidates))):
        if _binds(host, port):
            return port
    with socket.socket() as sock:  # no room below the ephemeral range on this host: any free port
        sock.bind((host, 0))
        return sock.getsockname()[1]
