"""The load steps of the live autoscaling tests, and their verdict: tests/integration/test_autoscale_serve.py
(one raylet) and tests/helm/autoscale_driver.py (a multi-raylet cluster built from the Helm chart's
autoscaling example). Not collected (no test_ prefix).

The latency profile is synthetic (prefill 2 ms per prompt token, decode step 20 ms + 100 ms per sequence),
so the decisions follow from the traffic the replicas measure, not from the machine's speed: 500-token
prompts at 1 rps predict rho 1 on one prefill replica; 24-token outputs at 1 rps need 23 tok/s against
8.3 tok/s per decode replica. Requests are bounded by count and each step by wall time."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

try:
    import httpx
except ImportError:  # the openai client here ships on httpx2
    import httpx2 as httpx

from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel

PROFILE = LatencyProfile({"default": LatencyModel(prefill=PrefillModel(a=0.004, b=2e-3, c=0.0, d=0.0), decode=DecodeModel(
    a=0.02, b=0.1, c=0.0), kv_bytes_per_token=4096)}).to_dict()
SCALING = {"profile": PROFILE, "min_replicas": 1, "max_replicas": 2, "ttft_slo_s": 2.0, "tpot_slo_s": 0.2,
           "upscale_delay_s": 1.0, "downscale_delay_s": 3.0, "cooldown_s": 0.0, "window_s": 4.0,
           "metrics_interval_s": 0.5, "drain_timeout_s": 30.0}
STEP_S = 75  # the most one step may take
# name, load (None: none), replicas per role to reach
STEPS: tuple[tuple[str, dict[str, float] | None, dict[str, int]], ...] = (
    ("long_prompts", {"rps": 1.0, "prompt_tokens": 500, "max_tokens": 2}, {"prefill": 2, "decode": 1}),
    ("quiet", None, {"prefill": 1, "decode": 1}),
    ("long_outputs", {"rps": 1.0, "prompt_tokens": 8, "max_tokens": 24}, {"prefill": 1, "decode": 2}),
    # down to a trickle (0.2 rps x 10 tokens: even a window that sees two requests' tokens and one arrival
    # stays within one replica at the downscale band): decode shrinks while requests still arrive on both
    # replicas, and every one of them completes
    ("trickle", {"rps": 0.2, "prompt_tokens": 8, "max_tokens": 10}, {"prefill": 1, "decode": 1}),
)


class Load:
    """Requests at a fixed rate from a thread pool until stopped; every (status, completion tokens) kept."""

    def __init__(self, url: str, model: str, rps: float, prompt_tokens: int, max_tokens: int) -> None:
        self.url, self.model, self.interval = url, model, 1 / rps
        self.prompt_tokens, self.max_tokens = int(prompt_tokens), int(max_tokens)
        self.pool = concurrent.futures.ThreadPoolExecutor(16)
        self.futures: list[concurrent.futures.Future] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _one(self, i: int) -> tuple[int, int]:
        prompt = [(i * 7 + k) % 370 + 5 for k in range(self.prompt_tokens)]  # no two alike: no prefix hits
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "ignore_eos": True}
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


def run_steps(url: str, model: str, replicas: Callable[[], dict[str, int]],
              on_reached: Callable[[dict[str, int]], Any] | None = None) -> list[dict[str, Any]]:
    """Runs STEPS in order, until one does not reach its replicas within STEP_S. Each step's record: name,
    want, reached, seen (replicas per role every half second), results, and what `on_reached` returned."""
    records = []
    for name, load_args, want in STEPS:
        load = None if load_args is None else Load(url, model, **load_args)
        record: dict[str, Any] = {"name": name, "want": want, "reached": False, "seen": [], "results": []}
        records.append(record)
        try:
            deadline = time.monotonic() + STEP_S
            while time.monotonic() < deadline:
                record["seen"].append(replicas())
                if record["seen"][-1] == want:
                    record["reached"] = True
                    record["snapshot"] = on_reached(want) if on_reached else None
                    break
                time.sleep(0.5)
            if name == "trickle" and record["reached"]:
                time.sleep(2)  # streams placed around the removal finish too
        finally:
            if load is not None:
                record["results"] = load.finish()
        if not record["reached"]:
            break
    return records


def failures(records: list[dict[str, Any]]) -> list[str]:
    """What the steps got wrong: an empty list when each role scaled on its own load alone and no request
    was lost (every one answered 200 with the tokens it asked for)."""
    out = [f"{r['name']}: never reached {r['want']}; last {r['seen'][-5:]}" for r in records if not r["reached"]]
    if len(records) < len(STEPS):
        out.append(f"stopped after {[r['name'] for r in records]}")
    steps = {r["name"]: r for r in records}
    if "long_prompts" in steps and max(s["decode"] for s in steps["long_prompts"]["seen"]) != 1:
        out.append(f"long prompts grew decode: {steps['long_prompts']['seen']}")
    if "long_outputs" in steps and max(s["prefill"] for s in steps["long_outputs"]["seen"]) != 1:
        out.append(f"long outputs grew prefill: {steps['long_outputs']['seen']}")
    for name, load_args, _ in STEPS:
        if name not in steps or load_args is None:
            continue
        results = [tuple(x) for x in steps[name]["results"]]
        if not results:
            out.append(f"{name}: no request sent")
        lost = [x for x in results if x != (200, load_args["max_tokens"])]
        if lost:
            out.append(f"{name}: {len(lost)} of {len(results)} requests failed or came back short: {lost[:5]}")
    return out
