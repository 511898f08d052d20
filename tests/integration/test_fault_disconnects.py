"""Clients that leave right after their first token, 50 times over, on a disaggregated app with the UCX
KV transport: the decode replica survives (same pid: it used to segfault when a cancelled KV pull freed
buffers UCX was still receiving into) and every block and lease comes back on both replicas."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from pdserve.services.decode.app import build_app as build_decode  # noqa: E402
from pdserve.services.prefill.app import build_app as build_prefill  # noqa: E402
from pdserve.services.router import RouterConfig, build_app  # noqa: E402
from pdserve.services.worker import WorkerConfig  # noqa: E402

APP = "fault-disconnect"
PROMPT = "A client that goes away right after its first token must cost the decode replica nothing. " * 6
NUM_DISCONNECTS = 50
HEALTH_BOUND_S = 1.5  # the client's timeout on /health: a slower answer fails the test
LEASE_TTL_S = 30.0


@pytest.fixture(scope="module")
def url(ray_serve):
    workers = WorkerConfig(num_blocks=256, num_cpus=0.5, transport="ucx", lease_ttl_s=LEASE_TTL_S)
    router = RouterConfig(num_cpus=0.25, disaggregate_min_prompt_tokens=16)
    ray_serve.run(build_app(router, build_prefill(workers), build_decode(workers)), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_serve.http_port}/{APP}"
    ray_serve.delete(APP)


def _idle(stats: dict) -> bool:
    return stats["num_free_blocks"] == stats["num_total_blocks"] and not (
        stats["num_leased_blocks"] or stats["num_running"] or stats["num_waiting"])


def test_fifty_disconnects_after_the_first_token(url, ray_serve, replica_pids):
    (decode_pid,) = replica_pids(APP, "decode")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as client:
        for i in range(NUM_DISCONNECTS):
            with client.stream("POST", f"{url}/v1/completions", json={**body, "prompt": f"{i} {PROMPT}"}) as resp:
                assert resp.status_code == 200
                next(resp.iter_raw())  # the first token, then the client goes
            if i % 10 == 9:  # /health answers within the bound meanwhile, and stays ready
                assert client.get(f"{url}/health", timeout=HEALTH_BOUND_S).status_code == 200
    assert replica_pids(APP, "decode") == [decode_pid]
    # every block and lease back well before the lease TTL
    handles = [ray_serve.get_deployment_handle(n, app_name=APP) for n in ("prefill", "decode")]
    deadline = time.monotonic() + LEASE_TTL_S / 2
    while not all(_idle(h.stats.remote().result()) for h in handles):
        assert time.monotonic() < deadline, [h.stats.remote().result() for h in handles]
        time.sleep(0.2)
    assert replica_pids(APP, "decode") == [decode_pid]
