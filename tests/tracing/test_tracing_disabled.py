"""Tracing off costs nothing visible: a NoOp tracer, no carrier; sampled-out traces export nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry.context import Context
from opentelemetry.trace import NoOpTracer

from pdserve.observability.tracing import Tracing
from pdserve.observability.tracing_config import TracingConfig

TRACEPARENT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


@pytest.mark.parametrize(
    "tracing",
    [
        Tracing.create(TracingConfig.from_env({}), "router"),
        Tracing.create(
            TracingConfig.from_env({"OTEL_TRACES_EXPORTER": "none", "PDSERVE_TRACE_CONTENT": "1"}), "decode"
        ),
        Tracing.create(
            TracingConfig.from_env({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}), "prefill"
        ),
        Tracing.disabled(),
    ],
    ids=["default", "none", "sdk-disabled", "disabled"],
)
def test_exporter_none_is_a_noop(tracing):
    assert not tracing.enabled
    assert isinstance(tracing.tracer, NoOpTracer)
    assert not tracing.record_content
    with tracing.span("chat tiny") as span:
        assert not span.is_recording()
        assert tracing.inject() == {}
        assert tracing.inject(span) == {}
    assert tracing.extract(TRACEPARENT) == Context()
    assert tracing.context_from_headers(TRACEPARENT) == Context()
    assert tracing.force_flush()
    tracing.shutdown()


def _marker_only(receiver, *, sampler: str, arg: str = "") -> None:
    """Spans made under `sampler` never arrive, while a later always-on marker does."""
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.grpc_endpoint}
    sampled_out = Tracing.create(
        TracingConfig.from_env({**env, "OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": arg}),
        "router",
    )
    downstream = Tracing.create(TracingConfig.from_env(env), "decode")  # parentbased_always_on
    for _ in range(50):
        with sampled_out.span("chat tiny") as span:
            carrier = sampled_out.inject(span)
            assert int(carrier["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0  # sampled flag off
            with downstream.span("pdserve.decode", context=downstream.extract(carrier)):
                pass
    assert sampled_out.force_flush() and downstream.force_flush()
    marker = Tracing.create(TracingConfig.from_env({**env, "OTEL_TRACES_SAMPLER": "always_on"}), "router")
    with marker.span("marker"):
        pass
    for t in (sampled_out, downstream, marker):
        t.shutdown()
    spans = receiver.wait_for(lambda got: any(s.name == "marker" for s in got))
    assert [s.name for s in spans] == ["marker"]


@pytest.mark.parametrize(
    "sampler,arg",
    [
        ("traceidratio", "0"),
        ("parentbased_traceidratio", "0.0"),
        ("always_off", ""),
        ("parentbased_always_off", ""),
    ],
)
def test_sampled_out_traces_export_nothing(otlp_receiver, sampler, arg):
    _marker_only(otlp_receiver, sampler=sampler, arg=arg)


def test_shutdown_is_idempotent_and_later_spans_are_dropped(otlp_receiver):
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": otlp_receiver.grpc_endpoint}
    tracing = Tracing.create(TracingConfig.from_env(env), "router")
    with tracing.span("before"):
        pass
    tracing.shutdown()
    tracing.shutdown()
    assert not tracing.enabled and tracing.inject() == {}
    with tracing.span("after"):
        pass
    assert [s.name for s in otlp_receiver.wait_for(bool)] == ["before"]


def test_tracing_modules_do_not_import_torch():
    code = (
        "import sys, pdserve.observability.tracing, pdserve.observability.tracing_config, pdserve.observability.trace_attributes, pdserve.observability.metrics, "
        "pdserve.observability.metrics_snapshot, pdserve.observability.slo; sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr or "torch was imported"
