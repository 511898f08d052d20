"""Tracing and metrics through the real Serve app: spans from the router, prefill and decode processes
arrive at an OTLP/gRPC receiver run here; /metrics merges every replica's series after known traffic."""

from __future__ import annotations

import asyncio
import importlib.util
import secrets
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
try:
    import httpx
except ImportError:  # the openai client here ships on httpx2
    import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.app import SystemConfig, build_system

APP = "pdserve-traced"
LONG_PROMPT = "The disaggregated prefill pool handles this long prompt: " * 2  # >= 32 tokens: disaggregated
REQUEST = {"model": "tiny", "max_tokens": 6, "ignore_eos": True, "temperature": 0.0, "top_p": 0.9}
NAMES = ("text_completion tiny", "pdserve.route", "pdserve.prefill", "pdserve.kv.transfer", "pdserve.decode")


def _receiver_module():
    name = "pdserve_tests_otlp_receiver"  # the same module name tests/tracing/conftest.py loads it under
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("otlp_receiver.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def receiver():
    receiver = _receiver_module().OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def server(ray_serve, receiver):
    tracing_env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                   "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.grpc_endpoint,
                   "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.0"}
    worker = {"num_cpus": 0.5, "num_blocks": 128}
    config = SystemConfig(prefill=worker, decode=worker, router={"num_cpus": 0}, tracing_env=tracing_env)
    ray_serve.run(build_system(config), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_serve.http_port}/{APP}"
    ray_serve.delete(APP)


def _complete(server, headers=None, **body):
    resp = httpx.post(f"{server}/v1/completions", json={**REQUEST, "prompt": LONG_PROMPT, **body},
                      headers=headers or {}, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def _trace(receiver, trace_id):
    """The spans of one trace, once all five stages arrived (batch exporters flush within ~5 s)."""
    spans = receiver.wait_for(lambda got: set(NAMES) <= {s.name for s in got if s.trace_id == trace_id}, 30)
    return {s.name: s for s in spans if s.trace_id == trace_id}


def test_span_tree_across_processes_honours_the_client_traceparent(server, receiver):
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    resp = _complete(server, headers={"traceparent": f"00-{trace_id}-{parent_id}-01"}, stream=True,
                     stream_options={"include_usage": True})
    assert resp.text.endswith("data: [DONE]\n\n")
    spans = _trace(receiver, trace_id)
    root = spans["text_completion tiny"]
    assert root.kind == "SERVER" and root.parent_span_id == parent_id  # a child of the client's span
    for name in ("pdserve.route", "pdserve.prefill", "pdserve.decode"):
        assert spans[name].parent_span_id == root.span_id, name
    assert spans["pdserve.kv.transfer"].parent_span_id == spans["pdserve.decode"].span_id
    services = {name: spans[name].service_name for name in NAMES}
    assert services["text_completion tiny"] == "pdserve-router"
    assert services["pdserve.prefill"] == "pdserve-prefill" and services["pdserve.decode"] == "pdserve-decode"
    assert len({spans[n].resource.get("process.pid") for n in NAMES} - {None}) in (0, 3)

    attrs = root.attributes
    assert attrs["gen_ai.operation.name"] == "text_completion" and attrs["gen_ai.request.model"] == "tiny"
    assert attrs["gen_ai.request.max_tokens"] == 6 and attrs["gen_ai.request.temperature"] == 0.0
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9) and attrs["gen_ai.request.stream"] is True
    assert attrs["gen_ai.usage.output_tokens"] == 6 and attrs["gen_ai.usage.input_tokens"] > 32
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["length"]
    assert attrs["gen_ai.response.id"].startswith("cmpl-")
    assert attrs["pdserve.disaggregate"] is True and attrs["pdserve.decision.reason"] == "long_prompt"
    assert spans["pdserve.prefill"].attributes["pdserve.prefill.chunks"] >= 1
    assert "pdserve.queue.seconds" in spans["pdserve.prefill"].attributes
    kv = spans["pdserve.kv.transfer"].attributes
    # the workers' default (ucx with same-host first): on one node the bytes go through shared memory
    assert kv["pdserve.kv.transport"] == "shm" and kv["pdserve.kv.blocks"] >= 3 and kv["pdserve.kv.bytes"] > 0
    assert spans["pdserve.decode"].attributes["pdserve.decode.tokens"] == 5  # the first came from prefill
    assert spans["pdserve.prefill"].attributes["pdserve.prefill.replica"]
    assert "prompt" not in str(attrs).lower() or "gen_ai.input.messages" not in attrs  # content is opt-in


def test_one_trace_per_request_and_chat_spans(server, receiver):
    ids = [_complete(server).json()["id"] for _ in range(2)]
    roots = receiver.wait_for(lambda got: len([s for s in got if s.attributes.get("gen_ai.response.id") in ids]) == 2, 30)
    traces = {s.trace_id for s in roots if s.attributes.get("gen_ai.response.id") in ids}
    assert len(traces) == 2
    resp = httpx.post(f"{server}/v1/chat/completions", timeout=60,
                      json={**REQUEST, "messages": [{"role": "user", "content": "hi"}]})
    chat_id = resp.json()["id"]
    spans = receiver.wait_for(lambda got: any(s.attributes.get("gen_ai.response.id") == chat_id for s in got), 30)
    (root,) = [s for s in spans if s.attributes.get("gen_ai.response.id") == chat_id]
    assert root.name == "chat tiny" and root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["pdserve.disaggregate"] is False  # a short chat prompt stays on decode


def test_grpc_metadata_traceparent_is_honoured(ray_serve, server, receiver):
    from pdserve.v1.client import GenerateClient, build_request

    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)

    async def call():
        async with GenerateClient(f"127.0.0.1:{ray_serve.grpc_port}", application=APP) as client:
            request = build_request("tiny", text=LONG_PROMPT, max_tokens=3, ignore_eos=True)
            metadata = [("application", APP), ("traceparent", f"00-{trace_id}-{parent_id}-01")]
            return [c async for c in client._stub.Generate(request, metadata=metadata)]

    # the stream groups tokens a slow reader missed into one message: count tokens, not messages
    assert sum(len(c.token_ids) for c in asyncio.run(call())) == 3
    assert _trace(receiver, trace_id)["text_completion tiny"].parent_span_id == parent_id


def _samples(server):
    text = httpx.get(f"{server}/metrics", timeout=30).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples, name, **labels):
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def test_metrics_count_known_traffic_across_roles(server):
    before = _samples(server)
    num_long, num_short = 3, 2
    for _ in range(num_long):
        _complete(server)
    for _ in range(num_short):
        _complete(server, prompt="Hi")
    after = _samples(server)

    def delta(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("pdserve_time_to_first_token_seconds_count", role="router") == num_long + num_short
    assert delta("pdserve_e2e_request_latency_seconds_count", role="router") == num_long + num_short
    assert delta("pdserve_time_per_output_token_seconds_count", role="router") == num_long + num_short
    assert delta("pdserve_generation_tokens_total", role="router") == 6 * (num_long + num_short)
    assert delta("pdserve_disaggregation_decisions_total", decision="disaggregate", reason="long_prompt") == num_long
    assert delta("pdserve_disaggregation_decisions_total", decision="skip", reason="short_prompt") == num_short
    assert delta("pdserve_request_prefill_seconds_count", role="prefill") == num_long
    assert delta("pdserve_kv_transfer_seconds_count", role="decode", transport="shm") == num_long
    assert delta("pdserve_request_decode_seconds_count", role="decode") == num_long + num_short
    assert delta("pdserve_generation_tokens_total", role="decode") == 5 * num_long + 6 * num_short
    assert delta("pdserve_router_requests_total", endpoint="completions", status="200") == num_long + num_short
    assert _value(after, "pdserve_kv_cache_usage_ratio", role="decode") == 0.0  # all requests done
    roles = {s.labels.get("role") for s in after if s.name == "pdserve_requests_running"}
    assert {"prefill", "decode"} <= roles
    attainment = [s for s in after if s.name == "pdserve_slo_attainment"]
    assert {s.labels["slo"] for s in attainment} == {"ttft", "tpot", "both"}
    assert all(0.0 <= s.value <= 1.0 for s in attainment)
