"""A real OTLP trace receiver for tests: gRPC (TraceService/Export) and HTTP (POST /v1/traces).

Both listen on free loopback ports and decode every exported span into a `SpanRecord`.
`wait_for(predicate, timeout)` blocks until the spans received so far satisfy the predicate.
"""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1 import trace_pb2

_KINDS = {v: k.removeprefix("SPAN_KIND_") for k, v in trace_pb2.Span.SpanKind.items()}
_STATUS = {v: k.removeprefix("STATUS_CODE_") for k, v in trace_pb2.Status.StatusCode.items()}


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return None if which is None else getattr(v, which)


def _attributes(kvs) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class SpanRecord:
    trace_id: str
    span_id: str
    parent_span_id: str | None  # None for a root span
    name: str
    kind: str  # INTERNAL | SERVER | CLIENT | PRODUCER | CONSUMER
    attributes: dict[str, Any]
    service_name: str | None
    resource: dict[str, Any] = field(repr=False)
    status: str = "UNSET"
    events: tuple[str, ...] = ()
    start_ns: int = 0
    end_ns: int = 0


def decode(request: trace_service_pb2.ExportTraceServiceRequest) -> list[SpanRecord]:
    records = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                records.append(
                    SpanRecord(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex() or None,
                        name=s.name,
                        kind=_KINDS.get(s.kind, str(s.kind)),
                        attributes=_attributes(s.attributes),
                        service_name=resource.get("service.name"),
                        resource=resource,
                        status=_STATUS.get(s.status.code, str(s.status.code)),
                        events=tuple(e.name for e in s.events),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                    )
                )
    return records


class OtlpReceiver:
    def __init__(self) -> None:
        self._spans: list[SpanRecord] = []
        self._cond = threading.Condition()
        self.requests = 0
        self._grpc: grpc.Server | None = None
        self._http: ThreadingHTTPServer | None = None
        self.grpc_port = self.http_port = 0

    @property
    def grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        """The full OTLP/HTTP traces URL (for OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)."""
        return f"http://127.0.0.1:{self.http_port}/v1/traces"

    def _add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        records = decode(request)
        with self._cond:
            self.requests += 1
            self._spans.extend(records)
            self._cond.notify_all()

    def start(self) -> OtlpReceiver:
        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                receiver._add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver._add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), self._grpc)
        self.grpc_port = self._grpc.add_insecure_port("127.0.0.1:0")
        self._grpc.start()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="otlp-http", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=None)
            self._grpc = None
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    @property
    def spans(self) -> list[SpanRecord]:
        with self._cond:
            return list(self._spans)

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()
            self.requests = 0

    def wait_for(
        self, predicate: Callable[[list[SpanRecord]], Any], timeout: float = 10.0
    ) -> list[SpanRecord]:
        """The spans received once `predicate(spans)` is truthy; AssertionError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(list(self._spans)):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(
                        f"timed out after {timeout}s; received: {[s.name for s in self._spans]}"
                    )
                self._cond.wait(remaining)
            return list(self._spans)

    def wait_for_names(self, *names: str, timeout: float = 10.0) -> dict[str, SpanRecord]:
        """Wait until a span with each name has arrived; the last one received per name."""
        spans = self.wait_for(lambda got: set(names) <= {s.name for s in got}, timeout)
        return {s.name: s for s in spans if s.name in names}
