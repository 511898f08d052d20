"""The router's placement step: live replica stats (+ what it placed since) and the prefix index -> policy ->
Placement.

The prompt is hashed once, with the replicas' block size, when any replica's pool is known (the prefix
index, fed by the replicas' KV events) or a kvstore is bound. The kvstore (the Redis tier's index) is
asked unless every replica holds the whole chain; a lookup that fails or takes longer than
`kvstore_timeout_s` is a miss. After the policy has chosen, the replica that prefills is told how
many leading blocks to pull from the Redis tier (`prefix_pull_blocks`): those the tier has beyond its
own pool, when the latency model predicts the pull faster than the prefill (without a profile, always).

`slo_aware` needs a latency profile (`pdserve profile --out FILE`, then `router.profile_path`); without
one the router places `least_loaded` and says so in its log and in `policy_name`. `kv_aware` works
either way (without a profile: cache affinity within a load slack).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

from pdserve.latency_model import LatencyProfile
from pdserve.prefix_hash import prompt_block_hashes
from pdserve.placement.pending import PendingPlacements
from pdserve.placement.policy import (
    Placement,
    PlacementConfig,
    PlacementRequest,
    Rejection,
    ReplicaSnapshot,
    create_policy,
)
from pdserve.placement.prefix_index import PrefixIndex, leading_hits
from pdserve.placement.sync import NoSync, PlacementSync, RemoteEntry
from pdserve.services.router.replica_stats import ReplicaStatsPoller
from pdserve.placement.slo_aware import is_pull_faster
from pdserve.worklink import LinkClient

logger = logging.getLogger(__name__)


class Placer:
    def __init__(
        self, config: PlacementConfig, profile: LatencyProfile | None, app_name: str, has_prefill: bool,
        workers: Mapping[str, Any] | None = None, kvstore: Any = None, links: LinkClient | None = None,
        on_poll: Callable[[str, str], None] | None = None, sync: PlacementSync | None = None,
    ) -> None:
        """`workers`: role -> deployment handle, to read the replicas' KV events (None: no prefix index);
        `kvstore`: the kvstore deployment's handle (None: no Redis tier lookups); `links` and `on_poll`:
        see ReplicaStatsPoller; `sync`: shares placements with the app's other routers (None: none)."""
        if config.policy == "slo_aware" and profile is None:
            logger.warning("slo_aware placement needs a latency profile (router.profile_path); using least_loaded")
            config = config.model_copy(update={"policy": "least_loaded"})
        self.config = config
        self.profile = profile
        self.has_prefill = has_prefill
        self.policy = create_policy(config, profile, has_prefill)
        roles = ("prefill", "decode") if has_prefill else ("decode",)
        self.index = PrefixIndex(config.prefix_max_age_s, config.prefix_expect_s)
        self.poller = ReplicaStatsPoller(app_name, roles, period_s=config.stats_poll_period_s,
                                         staleness_s=config.max_stats_age_s, kv_sources=workers, index=self.index,
                                         links=links, on_poll=on_poll)
        self.kvstore = kvstore
        self.pending = PendingPlacements()
        self.sync = sync or NoSync()
        self._observed: dict[str, float] = {}  # replica -> receive time of the stats already observed

    @property
    def policy_name(self) -> str:
        return self.config.policy

    def start(self) -> None:
        self.poller.start()
        self.sync.start(self._record_remote)

    def _record_remote(self, entries: list[RemoteEntry]) -> None:
        """Another router's placements; one that stats already received here must show is dropped."""
        for replica, prefill_tokens, blocks, placed_at in entries:
            if placed_at > self._observed.get(replica, float("-inf")) - self.pending.grace_s:
                self.pending.record(replica, prefill_tokens, blocks, placed_at)

    def snapshots(self, role: str) -> list[ReplicaSnapshot]:
        now = time.monotonic()
        out = []
        for s in self.poller.snapshots(role):
            if self._observed.get(s.replica) != s.received_at:
                self.pending.observe(s.replica, s.received_at)
                self._observed[s.replica] = s.received_at
            snap = ReplicaSnapshot.from_stats(s.replica, role, now - s.received_at, SimpleNamespace(**s.stats),
                                              prefix_hashes=self.index.held(s.replica))
            out.append(self.pending.apply(snap))
        return out

    async def place(
        self, request: PlacementRequest, prompt_token_ids: Sequence[int], key: Hashable = None
    ) -> Placement | Rejection:
        """`key` names the request: its placement loads the chosen replicas until stats show it or `done(key)`."""
        decode = self.snapshots("decode")
        prefill = self.snapshots("prefill") if self.has_prefill else []
        replicas = (*prefill, *decode)
        if decode and (self.kvstore is not None or any(s.prefix_hashes is not None for s in replicas)):
            hashes = prompt_block_hashes(prompt_token_ids, decode[0].block_size)
            least_held = min(leading_hits(hashes, s.prefix_hashes) for s in replicas)
            stored = await self._stored_blocks(hashes) if least_held < len(hashes) else 0
            request = dataclasses.replace(request, block_hashes=hashes,
                                          kvstore_hit_tokens=stored * decode[0].block_size)
        result = self.policy.place(request, prefill, decode)
        if isinstance(result, Placement) and decode:
            result = self._with_prefix(result, request, {s.replica_id: s for s in replicas})
            self.sync.publish(self.pending.record_placement(result, request, decode[0].block_size, key))
        return result

    def done(self, key: Hashable) -> None:
        """The request placed under `key` ended (finished, failed or aborted)."""
        self.pending.done(key)

    async def _stored_blocks(self, block_hashes: tuple[int, ...]) -> int:
        """Leading blocks of the chain in the Redis tier, by the kvstore; 0 when unknown or unreachable."""
        layout_hash = self.index.layout_hash()
        if self.kvstore is None or layout_hash is None or not block_hashes:
            return 0
        try:
            call = self.kvstore.lookup_prefix.remote(layout_hash, list(block_hashes))
            return int(await asyncio.wait_for(call, self.config.kvstore_timeout_s))
        except Exception as exc:  # a slow or failed lookup is a miss: placement never waits on the tier
            logger.debug("kvstore lookup failed: %s: %s", type(exc).__name__, exc)
            return 0

    def _with_prefix(
        self, placement: Placement, request: PlacementRequest, replicas: Mapping[str, ReplicaSnapshot]
    ) -> Placement:
        """The prefix the prefilling replica will find (its pool, then the Redis tier), and the
        expectation that its pool holds the prompt's blocks from now on."""
        prefilling = placement.prefill_replica if placement.disaggregate else placement.decode_replica
        snap = replicas.get(prefilling) if prefilling is not None else None
        if snap is None or not request.block_hashes:
            return placement
        bs = snap.block_size
        local = leading_hits(request.block_hashes, snap.prefix_hashes)
        stored = request.kvstore_hit_tokens // bs
        model = self.profile.for_role(snap.role) if self.profile is not None else None
        pull = stored if stored > local and is_pull_faster(
            model, self.config.kvstore_transport, (stored - local) * bs, local * bs) else 0
        for replica in {prefilling, placement.decode_replica} - {None}:  # decode adopts the prompt's blocks too
            self.index.expect(replica, request.block_hashes)
        hit = min(max(local, pull) * bs, request.num_prompt_tokens - 1)
        return dataclasses.replace(placement, prefix_hit_tokens=hit, prefix_pull_blocks=pull)

    async def close(self) -> None:
        await self.sync.close()
        await self.poller.close()
