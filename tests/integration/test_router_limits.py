"""Bounded queues: a full router answers 429, a full worker queue 503, both with Retry-After, and
neither leaves KV behind. Two small colocated apps on the shared Serve instance."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("ray")
try:
    import httpx
except ImportError:  # the openai client here ships on httpx2
    import httpx2 as httpx

from pdserve.services.decode.app import build_app as build_decode
from pdserve.services.router import RouterConfig, build_app
from pdserve.services.worker import WorkerConfig

LONG = {"model": "tiny", "prompt": "hold the line", "max_tokens": 1500, "ignore_eos": True, "stream": True}


def _deploy(ray_serve, name, router: RouterConfig, worker: WorkerConfig) -> str:
    ray_serve.run(build_app(router, None, build_decode(worker)), name=name, route_prefix=f"/{name}")
    return f"http://127.0.0.1:{ray_serve.http_port}/{name}"


def _kv_free(ray_serve, name) -> bool:
    stats = ray_serve.get_deployment_handle("decode", app_name=name).stats.remote().result()
    return stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_running"] == stats["num_waiting"] == 0


def _wait_kv_free(ray_serve, name) -> None:
    deadline = time.monotonic() + 15
    while not _kv_free(ray_serve, name):
        assert time.monotonic() < deadline, "KV still held after every client left"
        time.sleep(0.1)


async def _open_stream(http: httpx.AsyncClient, url: str):
    """Starts a long stream and returns once its first event arrived (the request then runs)."""
    resp = await http.send(http.build_request("POST", f"{url}/v1/completions", json=LONG), stream=True)
    assert resp.status_code == 200
    chunks = resp.aiter_raw()
    await anext(chunks)
    resp.chunks = chunks  # keep a reference: a dropped iterator closes the response
    return resp


def _wait_for_link(url: str) -> None:
    """Until a call went over the worker link: the bounds under test are then the link's (the same
    max_ongoing/max_queued as Serve's handles, which carry the calls of a replica's first ~100 ms)."""
    deadline = time.monotonic() + 60
    short = {**LONG, "max_tokens": 1, "stream": False}
    while 'pdserve_router_worker_calls_total{path="link",role="decode"}' not in httpx.get(f"{url}/metrics").text:
        assert time.monotonic() < deadline, "the router never used the worker link"
        httpx.post(f"{url}/v1/completions", json=short, timeout=60)
        time.sleep(0.1)


def _assert_retry(resp, status, code):
    assert resp.status_code == status, resp.text
    assert resp.headers["retry-after"] == "3"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code


@pytest.fixture(scope="module")
def limits(ray_serve):
    names = ["limits-router", "limits-worker"]
    urls = [
        _deploy(ray_serve, names[0], RouterConfig(mode="colocated", max_inflight=1, retry_after_s=3, num_cpus=0),
                WorkerConfig(num_blocks=256, num_cpus=0)),
        _deploy(ray_serve, names[1], RouterConfig(mode="colocated", retry_after_s=3, num_cpus=0),
                WorkerConfig(num_blocks=256, num_cpus=0, max_ongoing_requests=1, max_queued_requests=1)),
    ]
    yield dict(zip(names, urls))
    for name in names:
        ray_serve.delete(name)


def test_full_router_answers_429(ray_serve, limits):
    url = limits["limits-router"]

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            running = await _open_stream(http, url)
            try:
                _assert_retry(await http.post(f"{url}/v1/completions", json={**LONG, "stream": False}), 429,
                              "too_many_requests")
            finally:
                await running.aclose()

    asyncio.run(scenario())
    _wait_kv_free(ray_serve, "limits-router")
    text = httpx.get(f"{url}/metrics").text
    assert 'pdserve_rejections_total{model="tiny",reason="overloaded",replica=' in text
    assert 'pdserve_router_requests_total{endpoint="completions",status="429"} 1.0' in text


def test_full_worker_queue_answers_503(ray_serve, limits):
    """decode runs one call and queues one; another is refused (the link's RESOURCE_EXHAUSTED), mapped to 503."""
    url = limits["limits-worker"]
    _wait_for_link(url)

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as http:
            running = await _open_stream(http, url)
            probe = {**LONG, "stream": False, "max_tokens": 2}
            probes = [asyncio.create_task(http.post(f"{url}/v1/completions", json=probe)) for _ in range(2)]
            try:
                done, _ = await asyncio.wait(probes, return_when=asyncio.FIRST_COMPLETED)
                _assert_retry(done.pop().result(), 503, "overloaded")  # one queued behind `running`, one refused
            finally:
                await running.aclose()
            statuses = sorted([(await p).status_code for p in probes])
            assert statuses == [200, 503]  # the queued one ran once the first stream was gone

    asyncio.run(scenario())
    _wait_kv_free(ray_serve, "limits-worker")
