"""One rank of a tensor-parallel replica killed (`kill -9`) mid-stream. The replica exits at once, Serve
replaces it, and its streams move to the other replica and go on with no token missing or repeated, as
from a killed decode replica. Afterwards every rank process belongs to a live replica: none is left hung.

Colocated, tiny model, 2 decode replicas of 2 ranks each; seeded sampled streams are compared token for token
with a no-fault run of the same requests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import psutil
import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from pdserve.services.app import SystemConfig, build_system  # noqa: E402

APP, PREFIX = "pdserve-tp-fault", "/tpfault"
PROMPT = "One rank of this replica dies in the middle of the stream, and the stream must not notice. "
NUM_REQUESTS = 4
MAX_TOKENS = 48
RANK = "pdserve.engine.tp_worker"


@pytest.fixture(scope="module")
def url(ray_serve):
    config = SystemConfig(mode="colocated", model="tiny",
                          router={"num_cpus": 0, "placement": {"policy": "round_robin"}},
                          decode={"tensor_parallel_size": 2, "num_cpus": 0.25, "num_blocks": 64, "num_replicas": 2})
    ray_serve.run(build_system(config), name=APP, route_prefix=PREFIX)
    yield f"http://127.0.0.1:{ray_serve.http_port}{PREFIX}"
    ray_serve.delete(APP)


def _ranks(replica_pid: int) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(replica_pid).children() if RANK in " ".join(p.cmdline())]
    except psutil.NoSuchProcess:
        return []


def _all_ranks() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if RANK in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


async def _stream(client: httpx.AsyncClient, url: str, i: int, progress: list[int]) -> tuple[str, list, int]:
    body = {"model": "tiny", "prompt": f"{i}. {PROMPT}", "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "seed": 3000 + i, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    raw = b""
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for part in resp.aiter_bytes():
            raw += part
            progress[i] += part.count(b'"text"')
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"[DONE]"
    events = [json.loads(e) for e in events[:-1]]
    assert not [e for e in events if "error" in e], events
    text = "".join(c["text"] for e in events for c in e["choices"])
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    return text, finish, events[-1]["usage"]["completion_tokens"]


def _migrations(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_migrations_total{"))


def _wait_replicas(replica_pids, count: int, timeout_s: float = 180) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        pids = replica_pids(APP, "decode")
        if len(pids) == count and all(len(_ranks(pid)) == 1 for pid in pids):
            return pids
        assert time.monotonic() < deadline, f"decode replicas {pids}, ranks {[len(_ranks(p)) for p in pids]}"
        time.sleep(1)


def test_a_killed_rank_takes_its_replica_down_and_the_streams_move_on_exactly(url, replica_pids):
    async def run(kill: int | None) -> list[tuple[str, list, int]]:
        progress = [0] * NUM_REQUESTS
        async with httpx.AsyncClient(timeout=180) as client:
            tasks = [asyncio.create_task(_stream(client, url, i, progress)) for i in range(NUM_REQUESTS)]
            if kill is not None:
                while min(progress) < 4 and not all(t.done() for t in tasks):  # every stream is decoding
                    await asyncio.sleep(0.005)
                os.kill(kill, signal.SIGKILL)
            return await asyncio.gather(*tasks)

    before_pids = _wait_replicas(replica_pids, 2)
    baseline = asyncio.run(run(kill=None))
    assert all(finish == ["length"] and n == MAX_TOKENS for _, finish, n in baseline)
    migrations = _migrations(url)
    (victim,) = _ranks(before_pids[0])
    moved = asyncio.run(run(kill=victim.pid))
    assert moved == baseline  # same text, one finish, every token counted once
    assert _migrations(url) - migrations >= 1  # round robin put streams on the replica that lost its rank
    assert not psutil.pid_exists(before_pids[0]) or psutil.Process(before_pids[0]).status() == psutil.STATUS_ZOMBIE
    after_pids = _wait_replicas(replica_pids, 2)  # Serve replaced the replica, with both its ranks
    assert before_pids[1] in after_pids and before_pids[0] not in after_pids
    owners = {p.ppid() for p in _all_ranks() if p.ppid() in after_pids or p.ppid() in before_pids}
    assert owners == set(after_pids)  # no rank outlived its replica
    assert asyncio.run(run(kill=None)) == baseline  # and the replaced replica serves the same streams
