"""Placement through the real Serve app: the router polls every replica's stats, the policy picks a
replica, and PlacementRequestRouter sends the call there (two decode replicas, round robin)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")
try:
    import httpx
except ImportError:  # the openai client here ships on httpx2
    import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.app import SystemConfig, build_system

APP = "pdserve-placement"


@pytest.fixture(scope="module")
def server(ray_serve):
    config = SystemConfig(mode="colocated", decode={"num_replicas": 2, "num_cpus": 0, "num_blocks": 64},
                          router={"num_cpus": 0, "placement": {"policy": "round_robin"}})
    ray_serve.run(build_system(config), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_serve.http_port}/{APP}"
    ray_serve.delete(APP)


def _tokens_by_replica(server) -> dict[str, float]:
    text = httpx.get(f"{server}/metrics", timeout=30).text
    return {s.labels["replica"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "pdserve_generation_tokens_total" and s.labels.get("role") == "decode"}


def test_round_robin_alternates_between_the_replicas_it_sees(server):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    deadline = time.monotonic() + 30
    while len(_tokens_by_replica(server)) < 2:  # both replicas reported (metrics reach every replica in time)
        httpx.post(f"{server}/v1/completions", json=body, timeout=60)
        assert time.monotonic() < deadline, "the router never saw both decode replicas"
        time.sleep(0.3)
    time.sleep(0.5)  # the poller has fresh stats of both
    before = _tokens_by_replica(server)
    for _ in range(6):
        assert httpx.post(f"{server}/v1/completions", json=body, timeout=60).status_code == 200
    after = _tokens_by_replica(server)
    served = sorted(after[r] - before.get(r, 0) for r in after)
    assert served == [12.0, 12.0]  # 3 requests x 4 tokens on each, not left to Serve's random choice


def test_rejection_by_slo_is_a_429_with_retry_after(ray_serve):
    """slo_aware with a profile that predicts every prefill far over any SLO: admission rejects."""
    from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel

    slow = LatencyModel(prefill=PrefillModel(a=100.0, b=0.0, c=0.0, d=0.0),
                        decode=DecodeModel(a=100.0, b=0.0, c=0.0), kv_bytes_per_token=1024)
    profile = LatencyProfile(models={"default": slow}).to_dict()
    config = SystemConfig(mode="colocated", decode={"num_cpus": 0, "num_blocks": 64},
                          router={"num_cpus": 0, "placement": {"policy": "slo_aware"}, "profile": profile})
    ray_serve.run(build_system(config), name="pdserve-reject", route_prefix="/pdserve-reject")
    try:
        url = f"http://127.0.0.1:{ray_serve.http_port}/pdserve-reject"
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        deadline = time.monotonic() + 30
        while (resp := httpx.post(f"{url}/v1/completions", json=body, timeout=60)).status_code == 200:
            assert time.monotonic() < deadline, "placement never saw the replica's stats"
            time.sleep(0.3)  # before the first stats arrive the prompt-length rule places it
        assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
        assert resp.json()["error"]["code"] == "slo_unattainable"
        text = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'pdserve_rejections_total{' in text and 'reason="slo_' in text
    finally:
        ray_serve.delete("pdserve-reject")


def test_the_router_queue_holds_then_refuses_what_no_replica_can_take(ray_serve):
    """The same unplaceable profile with a router queue of 1: a request waits queue_timeout_s in the
    queue (shown by pdserve_router_queued_requests) and is then a 429; one arriving meanwhile finds the
    queue full and is a 429 at once."""
    import concurrent.futures

    from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel

    slow = LatencyModel(prefill=PrefillModel(a=100.0, b=0.0, c=0.0, d=0.0),
                        decode=DecodeModel(a=100.0, b=0.0, c=0.0), kv_bytes_per_token=1024)
    profile = LatencyProfile(models={"default": slow}).to_dict()
    config = SystemConfig(mode="colocated", decode={"num_cpus": 0, "num_blocks": 64},
                          router={"num_cpus": 0, "placement": {"policy": "slo_aware"}, "profile": profile,
                                  "queue_max_requests": 1, "queue_timeout_s": 3.0})
    ray_serve.run(build_system(config), name="pdserve-queue", route_prefix="/pdserve-queue")
    try:
        url = f"http://127.0.0.1:{ray_serve.http_port}/pdserve-queue"
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
        deadline = time.monotonic() + 30
        while httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200:
            assert time.monotonic() < deadline, "placement never saw the replica's stats"
            time.sleep(0.3)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            started = time.monotonic()
            waiting = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 2.5
            while 'pdserve_router_queued_requests 1.0' not in httpx.get(f"{url}/metrics", timeout=30).text:
                assert time.monotonic() < deadline, "the request never showed in the router's queue"
                time.sleep(0.1)
            full = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert full.status_code == 429  # refused at once: its message says full, not timed out
            assert "queue_full" in full.json()["error"]["message"]
            timed_out = waiting.result()
            assert timed_out.status_code == 429 and time.monotonic() - started >= 3.0
            assert "queue_timeout" in timed_out.json()["error"]["message"]
            assert int(timed_out.headers["retry-after"]) >= 1
        text = httpx.get(f"{url}/metrics", timeout=30).text
        assert 'pdserve_router_queued_requests 0.0' in text
        # the first refusal above had waited out the queue too
        assert 'pdserve_router_queue_outcomes_total{outcome="queued"} 2.0' in text
        assert 'pdserve_router_queue_outcomes_total{outcome="full"} 1.0' in text
        assert 'pdserve_router_queue_outcomes_total{outcome="timed_out"} 2.0' in text
    finally:
        ray_serve.delete("pdserve-queue")
