"""The router's placement step: live replica stats (+ what it placed since) -> policy -> Placement.

`slo_aware` needs a latency profile (`pdserve profile --out FILE`, then `router.profile_path`); without
one the router places `least_loaded` and says so in its log and in `policy_name`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from types import SimpleNamespace

from pdserve.latency_model import LatencyProfile
from pdserve.prefix_hash import prompt_block_hashes
from pdserve.services.router.pending import PendingPlacements
from pdserve.services.router.placement import (
    Placement,
    PlacementConfig,
    PlacementRequest,
    Rejection,
    ReplicaSnapshot,
    create_policy,
)
from pdserve.services.router.replica_stats import ReplicaStatsPoller

logger = logging.getLogger(__name__)


class Placer:
    def __init__(
        self, config: PlacementConfig, profile: LatencyProfile | None, app_name: str, has_prefill: bool,
    ) -> None:
        if config.policy == "slo_aware" and profile is None:
            logger.warning("slo_aware placement needs a latency profile (router.profile_path); using least_loaded")
            config = config.model_copy(update={"policy": "least_loaded"})
        self.config = config
        self.has_prefill = has_prefill
        self.policy = create_policy(config, profile, has_prefill)
        roles = ("prefill", "decode") if has_prefill else ("decode",)
        self.poller = ReplicaStatsPoller(app_name, roles, period_s=config.stats_poll_period_s,
                                         staleness_s=config.max_stats_age_s)
        self.pending = PendingPlacements()
        self._observed: dict[str, float] = {}  # replica -> receive time of the stats already observed

    @property
    def policy_name(self) -> str:
        return self.config.policy

    def start(self) -> None:
        self.poller.start()

    def snapshots(self, role: str) -> list[ReplicaSnapshot]:
        now = time.monotonic()
        out = []
        for s in self.poller.snapshots(role):
            if self._observed.get(s.replica) != s.received_at:
                self.pending.observe(s.replica, s.received_at)
                self._observed[s.replica] = s.received_at
            snap = ReplicaSnapshot.from_stats(s.replica, role, now - s.received_at, SimpleNamespace(**s.stats))
            out.append(self.pending.apply(snap))
        return out

    def place(self, request: PlacementRequest, prompt_token_ids: Sequence[int]) -> Placement | Rejection:
        decode = self.snapshots("decode")
        prefill = self.snapshots("prefill") if self.has_prefill else []
        if decode and any(s.prefix_hashes is not None for s in (*prefill, *decode)):  # prefix credit needs hashes
            hashes = prompt_block_hashes(prompt_token_ids, decode[0].block_size)
            request = dataclasses.replace(request, block_hashes=hashes)
        result = self.policy.place(request, prefill, decode)
        if isinstance(result, Placement) and decode:
            self.pending.record_placement(result, request, decode[0].block_size)
        return result

    async def close(self) -> None:
        await self.poller.close()
