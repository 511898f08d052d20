"""Spans reach a real OTLP receiver, and one trace spans two processes through an injected carrier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.trace import SpanKind

from pdserve.observability import trace_attributes as ta
from pdserve.observability.tracing import Tracing, trace_id_hex
from pdserve.observability.tracing_config import TracingConfig

CHILD = Path(__file__).with_name("child_span.py")
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


def _config(receiver, protocol: str = "grpc", **extra: str) -> TracingConfig:
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    return TracingConfig.from_env(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol,
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": endpoint,
            **extra,
        }
    )


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_trace_continues_across_processes(otlp_receiver, protocol):
    config = _config(otlp_receiver, protocol)
    router = Tracing.create(config, "router", replica="router-0")
    name = ta.request_span_name(ta.OPERATION_CHAT, "tiny")
    attrs = ta.request_attributes(ta.OPERATION_CHAT, "tiny", max_tokens=8, temperature=0.0, stream=True)
    with router.span(name, kind=SpanKind.SERVER, attributes=attrs) as root:
        carrier = router.inject()
        assert set(carrier) == {"traceparent"}
        child_env = {**os.environ, **config.to_env(), "PDSERVE_TEST_CARRIER": json.dumps(carrier)}
        result = subprocess.run(
            [sys.executable, str(CHILD)],
            check=False,
            env=child_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        root.set_attributes(
            ta.response_attributes(input_tokens=5, output_tokens=8, finish_reasons=["length"])
        )
    router.shutdown()

    spans = otlp_receiver.wait_for_names(name, ta.SPAN_DECODE)
    parent, child = spans[name], spans[ta.SPAN_DECODE]
    assert parent.trace_id == child.trace_id == trace_id_hex(root)
    assert parent.parent_span_id is None
    assert child.parent_span_id == parent.span_id
    assert (parent.kind, child.kind) == ("SERVER", "SERVER")
    assert (parent.service_name, child.service_name) == ("pdserve-router", "pdserve-decode")
    assert child.resource["service.instance.id"] == "decode-7"
    assert child.resource[ta.ROLE] == "decode"
    assert parent.attributes == {
        ta.OPERATION_NAME: "chat",
        ta.PROVIDER_NAME: "pdserve",
        ta.REQUEST_MODEL: "tiny",
        ta.REQUEST_MAX_TOKENS: 8,
        ta.REQUEST_TEMPERATURE: 0.0,
        ta.REQUEST_STREAM: True,
        ta.USAGE_INPUT_TOKENS: 5,
        ta.USAGE_OUTPUT_TOKENS: 8,
        ta.RESPONSE_FINISH_REASONS: ("length",),
    }
    assert child.attributes == {
        ta.DECODE_REPLICA: "decode-7",
        ta.KV_TRANSPORT: "ucx",
        ta.KV_BYTES: 1 << 20,
        ta.KV_BLOCKS: 4,
        ta.DISAGGREGATE: True,
        ta.QUEUE_SECONDS: 0.25,
    }
    assert child.events == (ta.EVENT_FIRST_TOKEN,)
    assert {s.trace_id for s in otlp_receiver.spans} == {parent.trace_id}


@pytest.mark.parametrize(
    "headers",
    [
        {
            "TraceParent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01",
            "tracestate": "vendor=abc",
            "Content-Type": "application/json",
        },
        [
            ("content-type", "application/json"),
            ("traceparent", f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"),
            ("TRACESTATE", "vendor=abc"),
        ],
    ],
    ids=["mapping", "pairs"],
)
def test_client_traceparent_is_honoured(otlp_receiver, headers):
    tracing = Tracing.create(_config(otlp_receiver), "router")
    with tracing.span(
        "chat tiny", context=tracing.context_from_headers(headers), kind=SpanKind.SERVER
    ) as span:
        carrier = tracing.inject(span)
    tracing.shutdown()

    received = otlp_receiver.wait_for_names("chat tiny")["chat tiny"]
    assert received.trace_id == CLIENT_TRACE_ID
    assert received.parent_span_id == CLIENT_SPAN_ID
    # what the router hands on names its own span, in the client's trace, with the client's tracestate
    assert carrier["traceparent"].split("-")[1:3] == [CLIENT_TRACE_ID, received.span_id]
    assert carrier["tracestate"] == "vendor=abc"


@pytest.mark.parametrize(
    "headers", [None, {}, {"traceparent": "garbage"}, {"traceparent": f"00-{'0' * 32}-{CLIENT_SPAN_ID}-01"}]
)
def test_missing_or_malformed_traceparent_starts_a_new_trace(otlp_receiver, headers):
    tracing = Tracing.create(_config(otlp_receiver), "router")
    with tracing.span("chat tiny", context=tracing.context_from_headers(headers)):
        pass
    tracing.shutdown()
    received = otlp_receiver.wait_for_names("chat tiny")["chat tiny"]
    assert received.parent_span_id is None
    assert received.trace_id not in (CLIENT_TRACE_ID, "0" * 32)


def test_unsampled_client_is_respected_by_parent_based_sampler(otlp_receiver):
    tracing = Tracing.create(_config(otlp_receiver), "router")
    unsampled = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-00"}
    with tracing.span("dropped", context=tracing.context_from_headers(unsampled)):
        pass
    with tracing.span("marker"):
        pass
    tracing.shutdown()
    spans = otlp_receiver.wait_for(lambda got: any(s.name == "marker" for s in got))
    assert [s.name for s in spans] == ["marker"]


def test_start_span_does_not_become_current_and_nests_explicitly(otlp_receiver):
    tracing = Tracing.create(_config(otlp_receiver), "prefill")
    outer = tracing.start_span(ta.SPAN_PREFILL)
    with tracing.span("unrelated") as unrelated:
        pass
    inner = tracing.start_span(ta.SPAN_KV_TRANSFER, context=tracing.extract(tracing.inject(outer)))
    inner.end()
    outer.end()
    tracing.shutdown()
    spans = otlp_receiver.wait_for_names(ta.SPAN_PREFILL, ta.SPAN_KV_TRANSFER, "unrelated")
    assert spans["unrelated"].parent_span_id is None
    assert spans["unrelated"].trace_id == trace_id_hex(unrelated) != spans[ta.SPAN_PREFILL].trace_id
    assert spans[ta.SPAN_KV_TRANSFER].parent_span_id == spans[ta.SPAN_PREFILL].span_id
