"""GenAI semantic-convention helpers, content opt-in, and the exporter= / console paths of Tracing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from pdserve.observability import trace_attributes as ta
from pdserve.observability.tracing import Tracing, trace_id_hex
from pdserve.observability.tracing_config import TracingConfig


def test_request_span_name_and_attributes():
    assert ta.request_span_name(ta.operation_name(chat=True), "tiny") == "chat tiny"
    assert ta.request_span_name(ta.operation_name(chat=False), "tiny") == "text_completion tiny"
    attrs = ta.request_attributes("chat", "tiny", max_tokens=16, top_p=0.9, stream=False, choice_count=1)
    assert attrs == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "pdserve",
        "gen_ai.request.model": "tiny",
        "gen_ai.request.max_tokens": 16,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.stream": False,
    }
    assert ta.request_attributes("chat", "m", choice_count=3)["gen_ai.request.choice.count"] == 3


def test_response_attributes():
    attrs = ta.response_attributes(
        response_id="cmpl-1", input_tokens=7, output_tokens=0, finish_reasons=("stop",)
    )
    assert attrs == {
        "gen_ai.response.id": "cmpl-1",
        "gen_ai.usage.input_tokens": 7,
        "gen_ai.usage.output_tokens": 0,
        "gen_ai.response.finish_reasons": ["stop"],
    }
    assert ta.response_attributes() == {}


def test_content_is_recorded_only_when_opted_in():
    assert ta.content_attributes(False, prompt="secret", completions=["x"]) == {}
    attrs = ta.content_attributes(True, prompt="héllo", completions=["a", "b"])
    assert json.loads(attrs[ta.INPUT_MESSAGES]) == [{"role": "user", "content": "héllo"}]
    assert json.loads(attrs[ta.OUTPUT_MESSAGES]) == [
        {"role": "assistant", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert json.loads(ta.content_attributes(True, prompt=chat)[ta.INPUT_MESSAGES]) == chat


def test_record_content_follows_config():
    on = TracingConfig.from_env({"PDSERVE_TRACE_CONTENT": "true"})
    assert Tracing.create(on, "router", exporter=InMemorySpanExporter()).record_content
    assert not Tracing.create(TracingConfig(), "router", exporter=InMemorySpanExporter()).record_content


def test_injected_exporter_and_resource():
    exporter = InMemorySpanExporter()
    config = TracingConfig.from_env(
        {"OTEL_SERVICE_NAME": "pdserve", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"}
    )
    tracing = Tracing.create(config, "prefill", replica="prefill-3", exporter=exporter)
    assert tracing.enabled
    with tracing.span(ta.SPAN_PREFILL, kind=SpanKind.SERVER) as span:
        span.set_attribute(ta.PREFILL_CHUNKS, 3)
    (finished,) = exporter.get_finished_spans()
    assert format(finished.context.trace_id, "032x") == trace_id_hex(span)
    assert finished.attributes[ta.PREFILL_CHUNKS] == 3
    resource = finished.resource.attributes
    assert resource["service.name"] == "pdserve"
    assert resource[ta.ROLE] == "prefill"
    assert resource["service.instance.id"] == "prefill-3"
    assert resource["deployment.environment"] == "test"
    tracing.shutdown()


def test_console_exporter_prints_spans():
    code = (
        "from pdserve.observability.tracing import Tracing; from pdserve.observability.tracing_config import TracingConfig\n"
        "t = Tracing.create(TracingConfig.from_env(), 'decode')\n"
        "with t.span('pdserve.decode'): pass\n"
        "t.shutdown()\n"
    )
    env = {**os.environ, **TracingConfig(exporters=("console",)).to_env()}
    result = subprocess.run([sys.executable, "-c", code], check=True, env=env, capture_output=True, text=True)
    assert '"name": "pdserve.decode"' in result.stdout
    assert '"service.name": "pdserve-decode"' in result.stdout
