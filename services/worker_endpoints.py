"""What prefill and decode replicas both answer: engine stats, metrics snapshots, routing stats."""

from __future__ import annotations

import dataclasses
from typing import Any


class WorkerEndpoints:
    """Mixin over a deployment's `engine` (AsyncLLMEngine) and `telemetry` (pdserve.telemetry.Telemetry)."""

    def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.engine.stats())

    def metrics_snapshot(self, target: dict[str, Any] | None = None) -> dict[str, Any]:
        """`target` ({"replica": id}) only steers the call to this replica; see PlacementRequestRouter."""
        return self.telemetry.worker_snapshot(self.engine.stats())

    def record_routing_stats(self) -> dict[str, Any]:
        """Polled by the router (and Serve) for placement: EngineStats plus this replica's id."""
        return {**dataclasses.asdict(self.engine.stats()), "replica": self.telemetry.replica}
