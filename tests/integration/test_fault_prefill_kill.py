"""A prefill replica killed (`kill -9`) with requests in flight: no client gets a 500. Requests whose
prefill was on it are prefilled by their decode replica (a counted `prefill_unavailable` fallback) or
answered 503 with Retry-After before any byte; requests already decoding continue (their KV pull
falls back to local prefill if it was cut)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from pdserve.services.decode.app import build_app as build_decode  # noqa: E402
from pdserve.services.prefill.app import build_app as build_prefill  # noqa: E402
from pdserve.services.router import RouterConfig, build_app  # noqa: E402
from pdserve.services.worker import WorkerConfig  # noqa: E402

APP = "fault-prefill"
PROMPT = "Every prefill in this test takes a while, so that several are in flight when it dies. " * 12
NUM_REQUESTS = 12
MAX_TOKENS = 24
HEALTH_BOUND_S = 1.5  # the client's timeout on /health: a slower answer fails the test


@pytest.fixture(scope="module")
def url(ray_serve):
    workers = WorkerConfig(num_blocks=512, num_cpus=0.5)
    router = RouterConfig(num_cpus=0.25, disaggregate_min_prompt_tokens=16)
    ray_serve.run(build_app(router, build_prefill(workers), build_decode(workers)), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_serve.http_port}/{APP}"
    ray_serve.delete(APP)


async def _one(client: httpx.AsyncClient, url: str, i: int, first: asyncio.Event) -> tuple[int, dict, list[dict]]:
    body = {"model": "tiny", "prompt": f"{i} {PROMPT}", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}
    raw = b""
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        async for part in resp.aiter_bytes():
            raw += part
            first.set()
    if resp.status_code != 200:
        return resp.status_code, dict(resp.headers), [json.loads(raw)]
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"[DONE]"
    return 200, dict(resp.headers), [json.loads(e) for e in events[:-1]]


def _fallbacks(url: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("pdserve_fallbacks_total{") and 'reason="prefill_unavailable"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_prefill_replica_killed_with_requests_in_flight_gives_no_500(url, replica_pids):
    (pid,) = replica_pids(APP, "prefill")
    before = _fallbacks(url)

    async def main():
        first = asyncio.Event()
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(_one(client, url, i, first)) for i in range(NUM_REQUESTS)]
            await first.wait()  # one prefill is done: the others are queued or running on the replica
            os.kill(pid, signal.SIGKILL)
            health = []
            while not all(t.done() for t in tasks):  # /health is timed throughout the fault
                resp = await client.get(f"{url}/health", timeout=HEALTH_BOUND_S)
                health.append((resp.status_code, resp.headers.get("retry-after")))
                await asyncio.sleep(0.1)
            return await asyncio.gather(*tasks), health

    results, health = asyncio.run(main())
    assert health and all(status == 200 or (status == 503 and retry) for status, retry in health), health
    statuses = [status for status, _, _ in results]
    assert 500 not in statuses and set(statuses) <= {200, 503}, statuses
    for status, headers, events in results:
        if status == 503:
            assert headers.get("retry-after") and events[0]["error"]["code"] == "unavailable"
            continue
        assert not [e for e in events if "error" in e], events  # nothing failed after the 200
        text = "".join(c["text"] for e in events for c in e["choices"])
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert finish == ["length"] and text
    assert statuses.count(200) >= NUM_REQUESTS // 2
    deadline = time.monotonic() + 120
    while not [p for p in replica_pids(APP, "prefill") if p != pid]:
        assert time.monotonic() < deadline, "Serve did not restart the prefill replica"
        time.sleep(1)
    # the kill hit requests in prefill: prefilled by decode instead (counted), or a clean 503
    assert _fallbacks(url) - before + statuses.count(503) >= 1
