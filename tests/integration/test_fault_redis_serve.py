"""`pdserve serve` as users run it (its own Redis, UCX KV transport) with its Redis server hung (SIGSTOP)
then killed (kill -9) during traffic: `/health` keeps answering (timed, reported) and says the Redis tier is down, then
up again once `pdserve serve` has restarted it; `pdserve_redis_up` goes 1 -> 0 -> 1; the killed server is
reaped, not left a zombie; every request in flight or sent meanwhile completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pdserve.runtime.ports import listen_port  # noqa: E402

PROMPT = "A Redis outage must cost a disaggregated deployment its cache tier and nothing else. " * 4
HEALTH_TIMEOUT_S = 5.0  # a hang fails the test; the latencies themselves are printed, not asserted


def _children(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(proc.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _redis_child(serve_pid: int) -> int | None:
    for pid in _children(serve_pid):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if state != "Z" and ("redis" in name or "valkey" in name):
            return pid
    return None


def _is_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "X"
    except FileNotFoundError:
        return True


def _redis_up(client: httpx.Client, url: str) -> float | None:
    text = client.get(f"{url}/metrics", timeout=30).text
    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == "pdserve_redis_up"]
    return values[0] if values else None


class Traffic(threading.Thread):
    """Sequential streamed completions until stopped; every outcome kept."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.outcomes = url, threading.Event(), []

    def run(self) -> None:
        body = {"model": "tiny", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client:
            i = 0
            while not self.stop.is_set():
                try:
                    with client.stream("POST", f"{self.url}/v1/completions",
                                       json={**body, "prompt": f"{i} {PROMPT}"}) as resp:
                        lines = [line for line in resp.iter_lines() if line.strip()]
                    chunks = [json.loads(line[6:]) for line in lines[:-1]]
                    ok = resp.status_code == 200 and lines[-1] == "data: [DONE]" and \
                        chunks[-1]["choices"][0].get("finish_reason") == "length"
                    self.outcomes.append("ok" if ok else f"{resp.status_code}: {lines[-3:]}")
                except httpx.HTTPError as exc:
                    self.outcomes.append(f"{type(exc).__name__}: {exc}")
                i += 1


def test_redis_killed_under_pdserve_serve(tmp_path):
    port = listen_port()
    log_path = tmp_path / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.services.cli", "serve", "--port", str(port),
                             "--grpc-port", "0", "--model", "tiny"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    health_latencies: list[float] = []
    traffic = Traffic(url)
    try:
        with httpx.Client() as client:

            def health() -> dict:
                start = time.monotonic()
                resp = client.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S)
                health_latencies.append(time.monotonic() - start)
                return resp.json()

            def until(predicate, timeout_s: float, what: str):
                deadline = time.monotonic() + timeout_s
                while not (found := predicate()):
                    assert proc.poll() is None, log_path.read_text()[-3000:]
                    assert time.monotonic() < deadline, f"{what}\n{log_path.read_text()[-3000:]}"
                    time.sleep(0.1)
                return found

            def served() -> bool:
                if "pdserve is serving" not in log_path.read_text():
                    return False
                try:
                    return health().get("redis", {}).get("status") == "up"
                except httpx.HTTPError:
                    return False

            until(served, 180, "pdserve serve did not come up with its Redis tier")
            assert "started a local Redis" in log_path.read_text() and ":***@" in log_path.read_text()
            assert _redis_up(client, url) == 1
            redis_pid = until(lambda: _redis_child(proc.pid), 10, "no Redis child process")
            traffic.start()
            until(lambda: len(traffic.outcomes) >= 2, 120, "no traffic completed before the fault")
            # first hung (SIGSTOP: connections open, nothing answers), for as long as the checks take, then killed
            os.kill(redis_pid, signal.SIGSTOP)
            health_latencies.clear()
            until(lambda: health().get("redis", {}).get("status") == "down", 15, "/health never said Redis is down")
            assert health()["status"] == "degraded"
            until(lambda: _redis_up(client, url) == 0, 15, "pdserve_redis_up never went to 0")
            os.kill(redis_pid, signal.SIGKILL)
            new_pid = until(lambda: _redis_child(proc.pid) not in (None, redis_pid) and _redis_child(proc.pid), 30,
                            "Redis was not restarted")
            assert _is_gone(redis_pid), "the killed Redis was left a zombie"
            until(lambda: health().get("redis", {}).get("status") == "up", 15, "/health never saw Redis back")
            assert _redis_up(client, url) == 1
            done_before = len(traffic.outcomes)
            until(lambda: len(traffic.outcomes) >= done_before + 2, 120, "no traffic completed after the restart")
            traffic.stop.set()
            traffic.join(120)
        assert traffic.outcomes and all(o == "ok" for o in traffic.outcomes), traffic.outcomes
        assert f"Redis (pid {redis_pid}) exited with -9" in log_path.read_text()
        assert f"Redis restarted (pid {new_pid}" in log_path.read_text()
        print(json.dumps({"health_during_fault_s": {"n": len(health_latencies), "max": max(health_latencies),
                                                     "mean": sum(health_latencies) / len(health_latencies)},
                          "requests": len(traffic.outcomes)}))
    finally:
        traffic.stop.set()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    assert proc.returncode == 0, log_path.read_text()[-3000:]
