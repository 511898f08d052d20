"""The simulator and the live system fed the same small trace: the disaggregated Serve app (router, one
prefill and two decode replicas, round robin, the router's defaults: prompts under 32 tokens prefilled on
decode, KV handed over in 256-token parts) against `pdserve.sim` built from the same SystemConfig fields
(`pdserve.sim.scenario.cluster_spec`, as `pdserve-loadtest validate` builds it). Requests go one after
another, so only the mechanisms decide, never timings. Per request, in order, both must agree on: where
its prompt was prefilled (prefill pool or its decode replica), which decode replica served it (named by
first appearance), the prompt tokens found in the prefix cache, the engine steps that computed its prompt,
and the tokens it generated. The live side is read as an operator reads it: each request's trace (root
span placement attributes, the prefill or decode span's chunk count) at a real OTLP receiver, and the
usage in the HTTP response."""

from __future__ import annotations

import importlib.util
import random
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
try:
    import httpx
except ImportError:  # the openai client here ships on httpx2
    import httpx2 as httpx

from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel
from pdserve.prefix_hash import prompt_block_hashes
from pdserve.services.app import SystemConfig, build_system
from pdserve.sim.cluster import Simulation
from pdserve.sim.config import SimRequest
from pdserve.sim.scenario import cluster_spec

APP = "pdserve-sim-vs-serve"
SYSTEM = {"mode": "disaggregated",
          "prefill": {"num_cpus": 0, "num_blocks": 256},
          "decode": {"num_replicas": 2, "num_cpus": 0, "num_blocks": 256},
          "router": {"num_cpus": 0, "placement": {"policy": "round_robin"}}}
BLOCK = 16


def _trace() -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens): short and long prompts, one in parts, prefixes sent again."""
    rng = random.Random(34)
    fresh = lambda n: [rng.randrange(3, 380) for _ in range(n)]  # noqa: E731
    short, mid, long = fresh(20), fresh(100), fresh(600)
    return [(short, 5),                  # under 32 tokens: prefilled on its decode replica
            (mid, 6),                    # prefill pool, one chunk
            (long, 4),                   # prefill pool in 256-token parts: three chunks
            (mid + fresh(40), 5),        # its first 96 tokens cached on the prefill replica
            (long + fresh(30), 3),       # 592 cached; the rest in one chunk
            (short + fresh(4), 6),       # short again: cached only where its first turn was decoded
            (fresh(300), 7),
            (short + fresh(8), 4)]


def _receiver():
    name = "pdserve_tests_otlp_receiver"  # the module name the other tracing tests load it under
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("otlp_receiver.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name].OtlpReceiver().start()


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _by_first_appearance(replicas: list[str | None]) -> list[int | None]:
    names: dict[str, int] = {}
    return [None if r is None else names.setdefault(r, len(names)) for r in replicas]


def live(serve, receiver, trace) -> list[tuple]:
    tracing_env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                   "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.grpc_endpoint,
                   "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.0"}
    serve.run(build_system(SystemConfig(**SYSTEM, tracing_env=tracing_env)), name=APP, route_prefix=f"/{APP}")
    url = f"http://127.0.0.1:{serve.http_port}/{APP}"
    try:
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health", timeout=30).json().get("replicas", {}).get("decode") != 2:
            assert time.monotonic() < deadline, "the router never saw both decode replicas"
            time.sleep(0.2)
        warm = random.Random(0)
        for n in (40, 10, 40, 10):  # both paths on both decode replicas, prefixes the trace never sends
            _complete(url, [warm.randrange(3, 380) for _ in range(n)], 2)
        time.sleep(1.0)  # the router's polls have every replica's stats
        replies = []
        for prompt, max_tokens in trace:
            replies.append(_complete(url, prompt, max_tokens))
            time.sleep(0.3)  # each request placed on stats taken after the previous one finished
        ids = {r["id"] for r in replies}

        def arrived(spans) -> bool:
            roots = {s.trace_id for s in spans if s.attributes.get("gen_ai.response.id") in ids}
            engines = {s.trace_id for s in spans if s.name in ("pdserve.prefill", "pdserve.decode")
                       and "pdserve.prefill.chunks" in s.attributes}
            return len(roots) == len(ids) and roots <= engines

        spans = receiver.wait_for(arrived, 60)
    finally:
        serve.delete(APP)
    rows = []
    for reply in replies:
        root = next(s for s in spans if s.attributes.get("gen_ai.response.id") == reply["id"])
        disaggregated = bool(root.attributes["pdserve.disaggregate"])
        prefilling = "pdserve.prefill" if disaggregated else "pdserve.decode"
        chunks = next(s.attributes["pdserve.prefill.chunks"] for s in spans
                      if s.trace_id == root.trace_id and s.name == prefilling)
        rows.append((disaggregated, root.attributes.get("pdserve.decode.replica"),
                     reply["usage"]["prompt_tokens_details"]["cached_tokens"], chunks,
                     reply["usage"]["completion_tokens"]))
    return rows


def simulated(trace) -> list[tuple]:
    """Timings here are arbitrary (any profile): requests 60 s apart, each alone in the system."""
    model = LatencyModel(PrefillModel(0.01, 1e-4, 0.0), DecodeModel(0.005, 1e-4, 1e-7), 1024)
    profile = LatencyProfile({"default": model})
    requests = [SimRequest(i, 10.0 + 60.0 * i, len(prompt), max_tokens, prompt_block_hashes(prompt, BLOCK))
                for i, (prompt, max_tokens) in enumerate(trace)]
    records = sorted(Simulation(cluster_spec(SYSTEM, profile), profile, requests).run(),
                     key=lambda r: r.request.index)
    assert [r.status for r in records] == ["ok"] * len(trace)
    return [(r.prefill_replica is not None, r.decode_replica, r.cached_tokens, r.prefill_chunks,
             r.request.output_tokens) for r in records]


def _named(rows: list[tuple]) -> list[tuple]:
    decode = _by_first_appearance([row[1] for row in rows])
    return [(row[0], d, *row[2:]) for row, d in zip(rows, decode)]


def test_simulator_and_serve_app_agree_request_by_request(ray_serve):
    trace = _trace()
    receiver = _receiver()
    try:
        measured = _named(live(ray_serve, receiver, trace))
    finally:
        receiver.stop()
    predicted = _named(simulated(trace))
    assert measured == predicted, "\n".join(f"{i}: live {m} sim {p}" for i, (m, p) in
                                             enumerate(zip(measured, predicted)))
    # the trace exercises what it is meant to: both paths, both decode replicas, parts, prefix hits
    assert {row[0] for row in measured} == {True, False} and {row[1] for row in measured} == {0, 1}
    assert max(row[3] for row in measured) >= 3 and sum(row[2] > 0 for row in measured) >= 2
