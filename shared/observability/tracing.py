"""One tracer per deployment, built from a TracingConfig, and W3C trace-context propagation.

Each deployment holds its own `Tracing` (an explicit TracerProvider, never the global one), so
several roles in one process (tests, colocated mode) keep their own resource and exporter.
With no exporter configured the tracer is OpenTelemetry's NoOpTracer and `inject` returns {}:
a disabled deployment pays a few hundred nanoseconds per span and sends no headers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import INVALID_SPAN, NoOpTracer, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdserve import __version__
from pdserve.observability.trace_attributes import ROLE
from pdserve.observability.tracing_config import TracingConfig

TRACER_NAME = "pdserve"
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = frozenset(_PROPAGATOR.fields)  # traceparent, tracestate
_EMPTY_CONTEXT = Context()


def build_sampler(config: TracingConfig) -> sampling.Sampler:
    ratio = config.sampler_ratio
    return {
        "always_on": lambda: sampling.ALWAYS_ON,
        "always_off": lambda: sampling.ALWAYS_OFF,
        "traceidratio": lambda: sampling.TraceIdRatioBased(ratio),
        "parentbased_always_on": lambda: sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": lambda: sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": lambda: sampling.ParentBasedTraceIdRatio(ratio),
    }[config.sampler]()


def build_exporter(config: TracingConfig, name: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    headers = dict(config.headers) or None
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter(endpoint=config.endpoint, headers=headers)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=config.endpoint, headers=headers)


def _trace_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> dict[str, str]:
    if headers is None:
        return {}
    items = headers.items() if isinstance(headers, Mapping) else headers
    return {k.lower(): v for k, v in items if k.lower() in _TRACE_HEADERS}


def context_from_headers(headers: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> Context:
    """The client's trace context from its `traceparent`/`tracestate` headers (any case, a mapping or
    (name, value) pairs). Missing or malformed headers give an empty Context: spans start a new trace."""
    return _PROPAGATOR.extract(_trace_headers(headers))


class Tracing:
    """A deployment's tracer plus propagation; create with `Tracing.create` or `Tracing.disabled`."""

    def __init__(self, config: TracingConfig, tracer: trace.Tracer, provider: TracerProvider | None) -> None:
        self.config = config
        self.tracer = tracer
        self._provider = provider

    @classmethod
    def create(
        cls,
        config: TracingConfig,
        role: str,
        *,
        service_name: str | None = None,
        replica: str | None = None,
        exporter: SpanExporter | None = None,
    ) -> Tracing:
        """`service.name` is `service_name`, else OTEL_SERVICE_NAME, else `pdserve-{role}`.
        `exporter` (tests) replaces the configured exporters, and turns tracing on regardless."""
        if exporter is None and not config.enabled:
            return cls(config, NoOpTracer(), None)
        attrs: dict[str, Any] = dict(config.resource_attributes)
        attrs["service.name"] = (
            service_name or config.service_name or attrs.get("service.name") or f"pdserve-{role}"
        )
        attrs["service.version"] = __version__
        attrs[ROLE] = role
        if replica:
            attrs["service.instance.id"] = replica
        provider = TracerProvider(sampler=build_sampler(config), resource=Resource.create(attrs))
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        for name in config.exporters if exporter is None else ():
            processor = BatchSpanProcessor if name == "otlp" else SimpleSpanProcessor
            provider.add_span_processor(processor(build_exporter(config, name)))
        return cls(config, provider.get_tracer(TRACER_NAME, __version__), provider)

    @classmethod
    def disabled(cls) -> Tracing:
        return cls(TracingConfig(), NoOpTracer(), None)

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    @property
    def record_content(self) -> bool:
        return self.enabled and self.config.record_content

    def start_span(
        self,
        name: str,
        *,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
    ) -> Span:
        """A span the caller must `end()`; not made current (for spans that outlive one block, e.g. streams).
        `context=None` parents it on the current span."""
        if self._provider is None:
            return INVALID_SPAN
        return self.tracer.start_span(name, context=context, kind=kind, attributes=attributes)

    def span(
        self,
        name: str,
        *,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
    ) -> AbstractContextManager[Span]:
        """A span that is current inside the `with` block, ended (with any exception recorded) on exit."""
        if self._provider is None:
            return nullcontext(INVALID_SPAN)  # attaching a non-recording span to the context buys nothing
        return self.tracer.start_as_current_span(name, context=context, kind=kind, attributes=attributes)

    def inject(self, target: Span | Context | None = None) -> dict[str, str]:
        """A carrier ({'traceparent': ..., maybe 'tracestate': ...}) for `target` (a span, a context, or
        the current context when None), to pass to another process; {} when tracing is off."""
        if self._provider is None:
            return {}
        context = trace.set_span_in_context(target) if isinstance(target, Span) else target
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=context)
        return carrier

    def extract(self, carrier: Mapping[str, str] | None) -> Context:
        """The context a carrier from `inject` stands for: pass it as `context=` to parent spans on it."""
        if self._provider is None or not carrier:
            return _EMPTY_CONTEXT
        return _PROPAGATOR.extract(carrier)

    def context_from_headers(self, headers: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> Context:
        if self._provider is None:
            return _EMPTY_CONTEXT
        return context_from_headers(headers)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        if self._provider is None:
            return True
        return self._provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop the exporters; later spans are dropped. Safe to call twice."""
        provider, self._provider = self._provider, None
        self.tracer = NoOpTracer()
        if provider is not None:
            provider.shutdown()


def trace_id_hex(span: Span) -> str | None:
    """The span's trace id as 32 lowercase hex digits (for logs, response headers); None when invalid."""
    ctx = span.get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else None
