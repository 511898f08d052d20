"""Serve's request routing for prefill and decode calls: the replica the placement chose, if any.

The router's placement (a pure function over replica stats) names a replica in the call's
`WorkerRequest.replica` (or, for the workers' own endpoints, a `{"replica": ...}` mapping); this
RequestRouter, configured on the worker deployments, sends the call there. A call without one, or naming a replica that is gone, goes to the least-loaded candidate by
the replicas' own routing stats (running + waiting), ties broken at random.
"""

from __future__ import annotations

import random
from typing import Any

from pdserve.api.contract import WorkerRequest
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

ROUTER_CLASS_PATH = "pdserve.services.replica_router.PlacementRequestRouter"


def target_replica(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    if isinstance(request, WorkerRequest):
        return request.replica
    return request.get("replica") if isinstance(request, dict) else None


def _load(replica: RunningReplica) -> tuple[int, float]:
    stats: dict[str, Any] = replica.routing_stats or {}
    return stats.get("num_running", 0) + stats.get("num_waiting", 0), random.random()


class PlacementRequestRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        target = target_replica(pending_request)
        if target is not None:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if chosen:
                return [chosen]
        return [sorted(candidate_replicas, key=_load)]
