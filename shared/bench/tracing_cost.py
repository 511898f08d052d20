"""Tracing overhead figures for `pdserve bench router --tracing`: the CPU that one request's spans
cost (a bound on the latency they can add), and a bootstrap interval for the measured p50 change."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from pdserve.observability import trace_attributes as ta
from pdserve.observability.tracing import Tracing
from pdserve.observability.tracing_config import TracingConfig


def _one_request(router: Tracing, prefill: Tracing, decode: Tracing, i: int) -> None:
    """The spans, attributes, events and carriers of one disaggregated request, as the services make them."""
    attrs = ta.request_attributes("text_completion", "tiny", max_tokens=16, temperature=0.0,
                                  top_p=1.0, stream=True, request_id=f"cmpl-{i}")
    span = router.start_span(ta.request_span_name("text_completion", "tiny"), kind=SpanKind.SERVER, attributes=attrs)
    with router.span(ta.SPAN_ROUTE, context=trace.set_span_in_context(span)) as route:
        placed = {ta.DISAGGREGATE: True, ta.DECISION_REASON: "slo", ta.PREFILL_REPLICA: "prefill#a",
                  ta.DECODE_REPLICA: "decode#b", "pdserve.placement.policy": "slo_aware"}
        span.set_attributes(placed)
        route.set_attributes({**placed, "pdserve.placement.meets_slo": True, "pdserve.placement.predicted_ttft_s": 0.0125,
                              "pdserve.placement.predicted_tpot_s": 0.005,
                              "pdserve.placement.candidates": ["prefill:a:ttft=0.0125", "decode:b:tpot=0.0050"]})
    carrier = router.inject(span)
    with prefill.span(ta.SPAN_PREFILL, context=prefill.extract(carrier)) as p:
        p.set_attributes({ta.QUEUE_SECONDS: 0.001, ta.PREFILL_CHUNKS: 1, ta.KV_BLOCKS: 1})
        handoff = prefill.inject()
    d = decode.start_span(ta.SPAN_DECODE, context=decode.extract(handoff))
    with decode.span(ta.SPAN_KV_TRANSFER, context=trace.set_span_in_context(d)) as kv:
        kv.set_attributes({ta.KV_TRANSPORT: "ucx", ta.KV_BYTES: 32768, ta.KV_BLOCKS: 1})
    d.set_attributes({ta.QUEUE_SECONDS: 0.0005, ta.PREFILL_CHUNKS: 0})
    span.add_event(ta.EVENT_FIRST_TOKEN)
    d.set_attribute("pdserve.decode.tokens", 16)
    d.end()
    span.set_attributes(ta.response_attributes(response_id=f"cmpl-{i}", model="tiny", input_tokens=16,
                                               output_tokens=16, finish_reasons=["length"]))
    span.end()


def cpu_per_request_us(otlp_endpoint: str, num_requests: int = 2000) -> dict[str, float]:
    """Process CPU (every thread: the batch exporters' encoding and gRPC included) per traced
    request, exporting to `otlp_endpoint`; and the same loop with tracing off."""
    config = TracingConfig.from_env({
        "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp_endpoint,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.0"})
    out = {}
    for name, cfg in (("off", TracingConfig()), ("on", config)):
        roles = [Tracing.create(cfg, role) for role in ("router", "prefill", "decode")]
        for i in range(200):  # warm-up: exporter channels, caches
            _one_request(*roles, i)
        for t in roles:
            t.force_flush()
        start = time.process_time()
        for i in range(num_requests):
            _one_request(*roles, i)
        for t in roles:
            t.force_flush()
        out[name] = (time.process_time() - start) / num_requests * 1e6
        for t in roles:
            t.shutdown()
    return {"tracing_cpu_us_per_request": round(out["on"] - out["off"], 1),
            "tracing_off_cpu_us_per_request": round(out["off"], 2)}


def bootstrap_p50_change_pct(base: list[float], traced: list[float], iters: int = 4000, seed: int = 0) -> list[float]:
    """95% bootstrap interval of 100 * (p50(traced) / p50(base) - 1), resampling each path's requests."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(base), np.asarray(traced)
    pa = np.median(rng.choice(a, (iters, len(a))), axis=1)
    pb = np.median(rng.choice(b, (iters, len(b))), axis=1)
    lo, hi = np.percentile(100 * (pb / pa - 1), [2.5, 97.5])
    return [round(float(lo), 2), round(float(hi), 2)]


def summarize(result: dict[str, Any], raw: dict[str, dict[str, list[float]]], sink_endpoint: str) -> None:
    """Adds the CPU bound and the intervals to `result` (raw: path -> level -> TTFT ms of each request)."""
    result.update(cpu_per_request_us(sink_endpoint))
    for level, block in result.items():
        if not level.startswith("concurrency_") or "tracing_overhead_ttft_p50_pct" not in block:
            continue
        c = level.removeprefix("concurrency_")
        block["tracing_overhead_ttft_p50_pct_ci95"] = bootstrap_p50_change_pct(raw["disaggregated"][c], raw["traced"][c])
        block["tracing_cpu_pct_of_ttft_p50"] = round(
            100 * result["tracing_cpu_us_per_request"] / 1e3 / block["disaggregated"]["ttft_ms_p50"], 2)


def otlp_sink():
    """An OTLP/gRPC trace endpoint that counts export calls and drops them (grpcio only: the payload
    is never parsed; an empty ExportTraceServiceResponse is zero bytes)."""
    from concurrent import futures

    import grpc

    calls = {"exports": 0, "bytes": 0}

    def export(request: bytes, context) -> bytes:
        calls["exports"] += 1
        calls["bytes"] += len(request)
        return b""

    handler = grpc.method_handlers_generic_handler("opentelemetry.proto.collector.trace.v1.TraceService", {
        "Export": grpc.unary_unary_rpc_method_handler(export, lambda b: b, lambda b: b)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, calls


def start_sink(sink: list) -> dict[str, str]:
    """Starts an OTLP sink into `sink` (server, port, counts); the OTEL_* env that exports every span to it."""
    sink.extend(otlp_sink())
    return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{sink[1]}",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.0"}
