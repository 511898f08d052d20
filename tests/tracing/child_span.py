"""Run by test_tracing_e2e in a child process: continue the trace carried in $PDSERVE_TEST_CARRIER.

Reads its tracing settings from the environment (as a Ray worker would) and exports over OTLP.
"""

from __future__ import annotations

import json
import os

from opentelemetry.trace import SpanKind

from pdserve.observability import trace_attributes as ta
from pdserve.observability.tracing import Tracing
from pdserve.observability.tracing_config import TracingConfig


def main() -> None:
    tracing = Tracing.create(TracingConfig.from_env(), "decode", replica="decode-7")
    assert tracing.enabled
    parent = tracing.extract(json.loads(os.environ["PDSERVE_TEST_CARRIER"]))
    with tracing.span(ta.SPAN_DECODE, context=parent, kind=SpanKind.SERVER) as span:
        span.set_attributes(
            {
                ta.DECODE_REPLICA: "decode-7",
                ta.KV_TRANSPORT: "ucx",
                ta.KV_BYTES: 1 << 20,
                ta.KV_BLOCKS: 4,
                ta.DISAGGREGATE: True,
                ta.QUEUE_SECONDS: 0.25,
            }
        )
        span.add_event(ta.EVENT_FIRST_TOKEN)
    tracing.shutdown()  # flushes the batch processor before the process exits


if __name__ == "__main__":
    main()
