"""SLO-driven autoscaling per role, live: the whole system (router, prefill, decode) as a Serve app with
`prefill.autoscaling` and `decode.autoscaling` (policy slo, 1..2 replicas, fast intervals). A step to
long-prompt load adds a prefill replica and not a decode one; a step to long-output load adds decode and
not prefill; with the load down to a trickle decode shrinks back to one, and every request completes.

The latency profile is synthetic (prefill 2 ms per prompt token, decode step 20 ms + 100 ms per sequence),
so the decisions follow from the traffic the replicas measure, not from this machine's speed: 500-token
prompts at 1 rps predict rho 1 on one prefill replica; 24-token outputs at 1 rps need 23 tok/s against
8.3 tok/s per decode replica. Requests are bounded by count and each phase by wall time."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

pytest.importorskip("ray")
try:
    import httpx
except ImportError:  # the openai client here ships on httpx2
    import httpx2 as httpx

from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel
from pdserve.services.app import SystemConfig, build_system

APP = "pdserve-autoscale"
PROFILE = LatencyProfile({"default": LatencyModel(prefill=PrefillModel(a=0.004, b=2e-3, c=0.0, d=0.0), decode=DecodeModel(
    a=0.02, b=0.1, c=0.0), kv_bytes_per_token=4096)}).to_dict()
SCALING = {"profile": PROFILE, "min_replicas": 1, "max_replicas": 2, "ttft_slo_s": 2.0, "tpot_slo_s": 0.2,
           "upscale_delay_s": 1.0, "downscale_delay_s": 3.0, "cooldown_s": 0.0, "window_s": 4.0,
           "metrics_interval_s": 0.5, "drain_timeout_s": 30.0}
PHASE_S = 75  # the most one phase may take


@pytest.fixture(scope="module")
def server(ray_serve):
    worker = {"num_cpus": 0, "num_blocks": 512, "autoscaling": SCALING}
    config = SystemConfig(prefill=worker, decode=worker, router={"num_cpus": 0, "disaggregate_min_prompt_tokens": 32})
    ray_serve.run(build_system(config), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_serve.http_port}/{APP}"
    ray_serve.delete(APP)


def replicas(ray_serve) -> dict[str, int]:
    """Replicas per role that Serve runs or is starting (not those stopping)."""
    deployments = ray_serve.status().applications[APP].deployments
    return {role: sum(n for state, n in deployments[role].replica_states.items() if state in ("RUNNING", "STARTING"))
            for role in ("prefill", "decode")}


class Load:
    """Requests at a fixed rate from a thread pool until stopped; every result kept."""

    def __init__(self, url: str, rps: float, prompt_tokens: int, max_tokens: int) -> None:
        self.url, self.interval, self.prompt_tokens, self.max_tokens = url, 1 / rps, prompt_tokens, max_tokens
        self.pool = concurrent.futures.ThreadPoolExecutor(16)
        self.futures: list[concurrent.futures.Future] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _one(self, i: int) -> tuple[int, int]:
        prompt = [(i * 7 + k) % 370 + 5 for k in range(self.prompt_tokens)]  # no two alike: no prefix hits
        body = {"model": "tiny", "prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True}
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=120)
        tokens = response.json()["usage"]["completion_tokens"] if response.status_code == 200 else -1
        return response.status_code, tokens

    def _run(self) -> None:
        i = 0
        while not self.stop.is_set() and i < 200:
            self.futures.append(self.pool.submit(self._one, i))
            i += 1
            self.stop.wait(self.interval)

    def finish(self) -> list[tuple[int, int]]:
        self.stop.set()
        self.thread.join()
        results = [f.result(timeout=180) for f in self.futures]
        self.pool.shutdown()
        return results


def wait_for(ray_serve, want: dict[str, int], seen: list[dict[str, int]], limit_s: float = PHASE_S) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        now = replicas(ray_serve)
        seen.append(now)
        if now == want:
            return
        assert time.monotonic() < deadline, f"never reached {want}; last {seen[-5:]}"
        time.sleep(0.5)


def test_each_role_scales_on_its_own_load_and_scale_down_loses_no_request(ray_serve, server):
    assert replicas(ray_serve) == {"prefill": 1, "decode": 1}
    seen: list[dict[str, int]] = []
    long_prompts = Load(server, rps=1.0, prompt_tokens=500, max_tokens=2)
    try:
        wait_for(ray_serve, {"prefill": 2, "decode": 1}, seen)
    finally:
        results = long_prompts.finish()
    assert max(s["decode"] for s in seen) == 1, seen  # long prompts never grew decode
    wait_for(ray_serve, {"prefill": 1, "decode": 1}, seen)

    seen.clear()
    long_outputs = Load(server, rps=1.0, prompt_tokens=8, max_tokens=24)
    try:
        wait_for(ray_serve, {"prefill": 1, "decode": 2}, seen)
    finally:
        results += long_outputs.finish()
    assert max(s["prefill"] for s in seen) == 1, seen  # long outputs never grew prefill

    # down to a trickle (0.2 rps x 10 tokens: even a window that sees two requests' tokens and one arrival
    # stays within one replica at the downscale band): decode shrinks while requests still arrive on both
    # replicas, and every one of them completes
    seen.clear()
    trickle = Load(server, rps=0.2, prompt_tokens=8, max_tokens=10)
    try:
        wait_for(ray_serve, {"prefill": 1, "decode": 1}, seen)
        time.sleep(2)  # streams placed around the removal finish too
    finally:
        trickle_results = trickle.finish()
    results += trickle_results
    assert trickle_results
    failed = [(status, tokens) for status, tokens in results if status != 200]
    assert not failed, failed
    assert {tokens for _, tokens in results} <= {2, 24, 10}
    assert {tokens for _, tokens in trickle_results} == {10}
