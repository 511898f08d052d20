"""The `kv_aware` placement policy: cache hits weighed against load.

With a latency profile, each decode replica with room gets a predicted TTFT (the earlier of a local
prefill there: its queue, then the prompt less the prefix it holds, beside its running decodes; and
the best prefill replica's) and TPOT (its decode step with the request in the batch). They are ranked
1. by the SLOs their predictions miss;
2. comfortable first: both predictions within `kv_aware_slo_headroom` of the SLOs;
3. among comfortable replicas, the longest cached prefix: the least prefill work, and work is what
   bounds the rate the pool sustains, so while the SLOs are safe the hit is taken even on a busier
   replica;
4. by the SLO-normalised latency `TTFT / TTFT SLO + TPOT / TPOT SLO`, then the most free blocks and
   the replica id.
A hot replica is not buried: once its queue or batch pushes a prediction past the headroom it competes
on cost, where its hit counts only as the prefill it saves. The rest (local or remote prefill,
admission) is `slo_aware`'s.

Without a profile: among the replicas whose load (running + waiting + pending requests) is within
`kv_aware_load_slack` of the least loaded one, the one holding the longest prefix of the prompt
(ties: the least loaded, the most free blocks, the replica id); the same on the prefill pool. Then the
prompt-length rule decides local or remote prefill.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from pdserve.latency_model import LatencyProfile
from pdserve.placement.policy import (
    Candidate, PlacementConfig, PlacementPolicy, PlacementRequest, ReplicaSnapshot,
)
from pdserve.placement.prefix_index import leading_hits
from pdserve.placement.slo_aware import SloAware, _free, _Option


class KvAware(SloAware):
    name = "kv_aware"

    def __init__(
        self, config: PlacementConfig, profile: LatencyProfile | None = None, has_prefill_pool: bool = True,
    ) -> None:
        PlacementPolicy.__init__(self, config, profile, has_prefill_pool)
        self.rng = random.Random(config.seed)
        if profile is not None:
            self.prefill_model = profile.for_role("prefill")
            self.decode_model = profile.for_role("decode")

    def choose(self, request, prefill, decode):
        if self.profile is None:
            return self._simple(request, self.by_affinity(request, prefill), self.by_affinity(request, decode))
        return super().choose(request, prefill, decode)

    def rank_decode(
        self, request: PlacementRequest, roomy: Sequence[_Option], prefill: Sequence[ReplicaSnapshot]
    ) -> list[tuple[float, _Option, Candidate]]:
        remote = self._remote_scores(request, prefill) if prefill else []
        earliest_remote = remote[0][0] if remote else math.inf
        scored = []
        for o in roomy:
            tpot = self.tpot_s(request, o)
            decodes = o.replica.num_running + o.replica.num_pending
            chunk, _ = self.chunk_budget(request, o, self.decode_model, decodes)
            ttft = min(self.prefill_s(request, o, self.decode_model, chunk, decodes), earliest_remote)
            misses = (ttft > request.ttft_slo_s) + (tpot > request.tpot_slo_s)
            headroom = self.config.kv_aware_slo_headroom
            comfortable = ttft <= headroom * request.ttft_slo_s and tpot <= headroom * request.tpot_slo_s
            cost = ttft / request.ttft_slo_s + tpot / request.tpot_slo_s
            rank = (misses, not comfortable, -o.credit if comfortable else 0, cost, -_free(o.replica),
                    o.replica.replica_id)
            scored.append((rank, cost, tpot, o))
        scored.sort(key=lambda t: t[0])
        return [(tpot, o, Candidate(o.replica.replica_id, "decode", "slo_cost", cost))
                for _, cost, tpot, o in scored]

    def pick_decode(self, request, ranked):
        return ranked[0]  # its own ranking (hits within the headroom) decides, not the TPOT alone

    def by_affinity(
        self, request: PlacementRequest, replicas: Sequence[ReplicaSnapshot]
    ) -> ReplicaSnapshot | None:
        if not replicas:
            return None
        lightest = min(r.load for r in replicas)
        near = [r for r in replicas if r.load <= lightest + self.config.kv_aware_load_slack]
        return min(near, key=lambda r: (-leading_hits(request.block_hashes, r.prefix_hashes), r.load,
                                        -(r.num_free_blocks - r.pending_blocks), r.replica_id))
