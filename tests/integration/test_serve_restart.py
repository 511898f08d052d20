"""`pdserve serve` and its ports: a port another program holds is refused at once, naming it, before Ray
starts; a server started right after one stopped on the same ports comes up (the stopped one waits for
its replicas to let go of the ports, and the new one waits out TIME_WAIT connections)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdserve.runtime.ports import listen_port

pytest.importorskip("ray")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _serve(port: int, grpc_port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pdserve.services.cli", "serve", "--model", "tiny",
                             "--port", str(port), "--grpc-port", str(grpc_port)],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV)


def _healthy(proc: subprocess.Popen, port: int, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "pdserve serve did not become healthy"
        if "pdserve is serving" in log.read_text():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.5)


def _complete(port: int) -> str:
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json", "Connection": "close"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())["choices"][0]["text"]


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_a_port_another_program_holds_is_refused_naming_it(tmp_path, flag):
    port, grpc_port = listen_port(), listen_port()
    taken = port if flag == "--port" else grpc_port
    with socket.socket() as other:
        other.bind(("127.0.0.1", taken))
        other.listen()
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "serve", "--model", "tiny",
                               "--port", str(port), "--grpc-port", str(grpc_port)],
                              capture_output=True, text=True, timeout=120, env=ENV)
        elapsed = time.monotonic() - start
    print(f"refused in {elapsed:.1f} s")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"port {taken} ({flag}) is in use by another program" in done.stderr
    assert "CPU split" not in done.stdout and "Traceback" not in done.stderr  # nothing was started


def test_a_restart_right_after_a_stop_serves(tmp_path):
    port, grpc_port = listen_port(), listen_port()
    first = _serve(port, grpc_port, tmp_path / "first.log")
    try:
        _healthy(first, port, tmp_path / "first.log")
        text = _complete(port)
        for _ in range(3):  # connections the server closes first: TIME_WAIT on its port after it stops
            assert _complete(port) == text
    finally:
        assert _stop(first) == 0, (tmp_path / "first.log").read_text()[-3000:]
    second = _serve(port, grpc_port, tmp_path / "second.log")  # at once, on the same ports
    try:
        _healthy(second, port, tmp_path / "second.log")
        assert _complete(port) == text
    finally:
        assert _stop(second) == 0, (tmp_path / "second.log").read_text()[-3000:]


def test_a_port_taken_after_the_check_is_reported_as_the_router_failing_to_bind(tmp_path):
    """A program that takes the port between the check at start and the router replica's bind: Serve only
    says the router deployment failed; pdserve serve says which port, and who holds it."""
    port, grpc_port = listen_port(), listen_port()
    log = tmp_path / "serve.log"
    proc = _serve(port, grpc_port, log)
    with socket.socket() as other:
        try:
            deadline = time.monotonic() + 60
            while "CPU split" not in log.read_text():  # checked and free; Ray is up, Serve not yet
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            other.bind(("127.0.0.1", port))
            other.listen()
            code = proc.wait(180)
        finally:
            if proc.poll() is None:
                _stop(proc)
    output = log.read_text()
    assert code == 2, output[-3000:]
    assert (f"the router replica could not bind port {port} (--port): another program took it after start, "
            f"pid {os.getpid()}") in output
    assert "deployment failed:" not in output  # pdserve's own generic error, with its traceback
