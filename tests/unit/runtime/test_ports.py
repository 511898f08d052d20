"""Port states with real sockets: free, a listener (in use by a program), and a closed server's TIME_WAIT
connections, which keep a port from the plain bind Ray Serve's ingress does."""

from __future__ import annotations

import socket
import threading
import time

from pdserve.runtime.ports import FREE, IN_USE, TIME_WAIT, port_state, wait_bindable, wait_released
from pdserve.runtime.redis_server import free_port

HOST = "127.0.0.1"


def _listener(port: int) -> socket.socket:
    server = socket.socket()  # as Serve binds: no SO_REUSEADDR
    server.bind((HOST, port))
    server.listen()
    return server


def _time_wait(port: int) -> None:
    """A server on `port` that closes an accepted connection first, then stops listening."""
    server = _listener(port)
    client = socket.create_connection((HOST, port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first: it keeps the TIME_WAIT
    client.recv(1)
    client.close()
    server.close()


def test_states():
    port = free_port()
    assert port_state(HOST, port) == FREE
    with _listener(port):
        assert port_state(HOST, port) == IN_USE
    _time_wait(port)
    assert port_state(HOST, port) == TIME_WAIT


def test_a_listener_is_reported_after_the_grace_a_free_port_at_once():
    busy, free = free_port(), free_port()
    with _listener(busy):
        start = time.monotonic()
        blocked = wait_bindable(HOST, {"--port": busy, "--grpc-port": free}, threading.Event(), print,
                                in_use_grace_s=0.3, poll_s=0.05)
        assert blocked == {"--port": IN_USE} and time.monotonic() - start < 5
    assert wait_bindable(HOST, {"--port": free}, threading.Event(), print) == {}


def test_time_wait_is_waited_out_and_said_once():
    port = free_port()
    _time_wait(port)
    said: list[str] = []
    blocked = wait_bindable(HOST, {"--port": port}, threading.Event(), said.append, timeout_s=0.4, poll_s=0.05)
    assert blocked == {"--port": TIME_WAIT}  # Linux keeps it 60 s; this test waits less
    assert len(said) == 1 and f"port {port} (--port)" in said[0] and "TIME_WAIT" in said[0]


def test_a_stop_request_ends_the_wait():
    port = free_port()
    _time_wait(port)
    stop = threading.Event()
    stop.set()
    start = time.monotonic()
    wait_bindable(HOST, {"--port": port}, stop, print)
    assert time.monotonic() - start < 2


def test_wait_released_returns_once_the_listener_is_gone():
    port = free_port()
    server = _listener(port)
    threading.Timer(0.3, server.close).start()
    assert wait_released(HOST, [port], timeout_s=5) == []
    with _listener(port):
        assert wait_released(HOST, [port], timeout_s=0.2) == [port]


def test_holder_names_the_listening_process():
    import os

    from pdserve.runtime.ports import holder

    port = free_port()
    assert holder(port) is None
    with _listener(port):
        name = holder(port)
    assert name is not None and name.startswith(f"pid {os.getpid()} (")


def test_listen_port_is_free_and_below_the_ephemeral_range():
    from pathlib import Path

    from pdserve.runtime.ports import RAY_WORKER_PORTS, listen_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {listen_port() for _ in range(20)}
    assert len(ports) > 1  # not one fixed port: concurrent servers do not collide
    for port in ports:
        assert port_state(HOST, port) == FREE
        if low > RAY_WORKER_PORTS.stop:
            assert RAY_WORKER_PORTS.stop <= port < low
