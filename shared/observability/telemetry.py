"""One replica's tracing and metrics, named after the replica Serve runs it as."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pdserve.observability.metrics import ServingMetrics
from pdserve.observability.slo import SloWindow
from pdserve.observability.tracing import Tracing
from pdserve.observability.tracing_config import TracingConfig


def replica_name(role: str) -> str:
    """Serve's replica id inside a replica; `{role}-{pid}` anywhere else (tests, direct use)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica
        return f"{role}-{os.getpid()}"


class Telemetry:
    """`tracing_env` overrides this process's OTEL_* variables (configs travel to Ray workers, env may not)."""

    def __init__(
        self, role: str, model: str, tracing_env: Mapping[str, str] | None = None, slo: SloWindow | None = None
    ) -> None:
        self.role = role
        self.replica = replica_name(role)
        self.tracing = Tracing.create(TracingConfig.from_env({**os.environ, **(tracing_env or {})}), role,
                                      replica=self.replica)
        self.metrics = ServingMetrics(role, self.replica, model, slo=slo)

    def parent(self, carrier: Mapping[str, str] | None):
        """The trace context a caller sent (a W3C carrier, `WorkerRequest.trace`), or a fresh root."""
        return self.tracing.extract(carrier or {})

    def worker_snapshot(self, stats) -> dict[str, Any]:
        """Gauges refreshed from EngineStats, then this replica's metrics as plain data."""
        if stats.num_total_blocks:
            self.metrics.set_kv_cache_usage(1.0 - stats.num_free_blocks / stats.num_total_blocks)
        self.metrics.set_running(stats.num_running)
        self.metrics.set_waiting(stats.num_waiting)
        self.metrics.steps.update(getattr(stats, "step_totals", None))
        return {"replica": self.replica, "role": self.role, "metrics": self.metrics.snapshot()}

    def close(self) -> None:
        self.tracing.shutdown()
