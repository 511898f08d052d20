"""Leases end with their requests, not with their TTL: clients that leave right after the first token, or
before it (while prefill runs), on a disaggregated app with the UCX KV transport. Once the workers are idle,
`/metrics` shows no lease in any state and no KV block in use on either role within 2 s, far inside the
30 s lease TTL (the router's `pdserve_kv_leases{role,state}` and `pdserve_kv_cache_usage_ratio` series,
merged from the workers)."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pdserve.services.decode.app import build_app as build_decode  # noqa: E402
from pdserve.services.prefill.app import build_app as build_prefill  # noqa: E402
from pdserve.services.router import RouterConfig, build_app  # noqa: E402
from pdserve.services.worker import WorkerConfig  # noqa: E402

APP = "fault-leases"
PROMPT = "Every lease a request takes must be given back when its client leaves, not when it expires. " * 6
LEASE_TTL_S = 30.0
QUIESCENCE_BOUND_S = 2.0


@pytest.fixture(scope="module")
def url(ray_serve):
    workers = WorkerConfig(num_blocks=256, num_cpus=0.5, transport="ucx", lease_ttl_s=LEASE_TTL_S)
    router = RouterConfig(num_cpus=0.25, disaggregate_min_prompt_tokens=16)
    ray_serve.run(build_app(router, build_prefill(workers), build_decode(workers)), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_serve.http_port}/{APP}"
    ray_serve.delete(APP)


def _series(client: httpx.Client, url: str) -> dict[tuple[str, tuple], float]:
    text = client.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k in ("role", "state")))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in ("pdserve_kv_leases", "pdserve_kv_cache_usage_ratio")}


def _is_idle(handles) -> bool:
    stats = [h.stats.remote().result() for h in handles]
    return not any(s["num_running"] or s["num_waiting"] for s in stats)


def test_leases_and_blocks_are_back_within_two_seconds_of_quiescence(url, ray_serve):
    body = {"model": "tiny", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        for i in range(12):
            # after the first token: prefill's lease was pulled (or the pull is cut), decode's sequence aborts
            with client.stream("POST", f"{url}/v1/completions", json={**body, "prompt": f"{i} {PROMPT}"}) as resp:
                assert resp.status_code == 200
                next(resp.iter_raw())
            # before the first token: the client is gone while prefill runs or its KV is on offer
            try:
                with client.stream("POST", f"{url}/v1/completions", json={**body, "prompt": f"early {i} {PROMPT}"},
                                   timeout=httpx.Timeout(60, read=0.02 + 0.01 * i)) as resp:
                    next(resp.iter_raw())
            except httpx.ReadTimeout:
                pass
        handles = [ray_serve.get_deployment_handle(n, app_name=APP) for n in ("prefill", "decode")]
        deadline = time.monotonic() + LEASE_TTL_S / 2
        while not _is_idle(handles):
            assert time.monotonic() < deadline, "the workers did not go idle"
            time.sleep(0.05)
        quiet = time.monotonic()
        while True:
            series = _series(client, url)
            if series and not any(series.values()):
                break
            assert time.monotonic() - quiet < QUIESCENCE_BOUND_S, {k: v for k, v in series.items() if v}
            time.sleep(0.05)
    # every role and state is exposed (a missing series would pass the all-zero check vacuously)
    leases = {labels for name, labels in series if name == "pdserve_kv_leases"}
    assert {(("role", r), ("state", s)) for r in ("prefill", "decode") for s in ("held", "exported")} <= leases
    assert {labels for name, labels in series if name == "pdserve_kv_cache_usage_ratio"} >= {
        (("role", "prefill"),), (("role", "decode"),)}
