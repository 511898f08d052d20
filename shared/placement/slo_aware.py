"""The `slo_aware` placement policy: decode replica first, then local prefill or the earliest prefill replica.

1. Decode: the replica must hold the request's KV (prompt + max_tokens, less its local prefix hit)
   after the queued and pending work, and its predicted TPOT with the request in the batch must be
   within the TPOT SLO. Lowest TPOT wins; ties go to the most free blocks, then the replica id.
2. Local prefill on that decode replica when the predicted TTFT (its queued prefill tokens, then this
   prompt less the prefix credit, in chunks that share steps with its decodes) is within the TTFT SLO
   and a chunk step keeps its running sequences within the TPOT SLO.
3. Otherwise the prefill replica with the earliest predicted first token: its queue, this prompt less
   the prefix credit, and the KV transfer to the decode replica.

Prefix credit: the longest run of the prompt's block hashes cached on the replica (the router's prefix
index), or the Redis tier's hit when pulling its extra blocks (at the kvstore transport's cost) is
predicted faster than computing them; at least one token is computed.

Chunk budget: the largest multiple of the block size c (one block at least, at most the token budget
the replica reports)
with `mixed_step(batch, context, c) <= TPOT SLO` on a replica with running decodes, and
`prefill_time(c) <= chunk_ttft_fraction x TTFT SLO` everywhere, so a long prompt never holds a step
long enough to starve the requests queued behind it.

Every prediction is multiplied by the replica's slowdown (measured / predicted recent step time) and,
for stale stats, by the stale penalty.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pdserve.latency_model import LatencyModel, LatencyProfile
from pdserve.placement.policy import (
    Candidate, Placement, PlacementConfig, PlacementPolicy, PlacementRequest, Rejection, ReplicaSnapshot,
)
from pdserve.placement.prefix_index import leading_hits

T = TypeVar("T")


@dataclass(frozen=True)
class _Option:
    replica: ReplicaSnapshot
    scale: float  # slowdown x stale penalty
    credit: int  # prompt tokens not recomputed
    local_hit: int  # of those, tokens whose blocks the replica already holds
    pull_s: float  # fetching the kvstore part of the credit


def largest_chunk(step_s: Callable[[int], float], limit_s: float, block_size: int, max_chunk: int) -> int:
    """Largest multiple of `block_size` in [block_size, max_chunk] whose step time is within `limit_s`
    (`step_s` is non-decreasing); one block when none is."""
    lo, hi = 1, max(1, max_chunk // block_size)
    if step_s(lo * block_size) > limit_s:
        return block_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step_s(mid * block_size) <= limit_s:
            lo = mid
        else:
            hi = mid - 1
    return lo * block_size


def prefix_hit_tokens(block_hashes: Sequence[int], cached: Container[int] | None, block_size: int) -> int:
    return leading_hits(block_hashes, cached) * block_size


def pull_s(model: LatencyModel | None, transport: str | None, num_tokens: int) -> float:
    """Predicted time to pull `num_tokens` of KV from the Redis tier; 0 without a transfer model for it."""
    if model is None or transport is None or transport not in model.transfers or num_tokens <= 0:
        return 0.0
    return model.kv_transfer_s(num_tokens, transport)


def is_pull_faster(model: LatencyModel | None, transport: str | None, num_tokens: int, num_cached: int) -> bool:
    """Pulling `num_tokens` of KV beats computing them after `num_cached` cached tokens; without a
    latency model, assumed (a pull moves bytes, a prefill runs the model)."""
    if model is None or num_tokens <= 0:
        return num_tokens > 0
    return pull_s(model, transport, num_tokens) < model.prefill_time_s(num_tokens, num_cached)


class SloAware(PlacementPolicy):
    name = "slo_aware"

    def __init__(
        self, config: PlacementConfig, profile: LatencyProfile | None = None, has_prefill_pool: bool = True,
    ) -> None:
        if profile is None:
            raise ValueError("slo_aware placement needs a latency profile")
        super().__init__(config, profile, has_prefill_pool)
        self.prefill_model = profile.for_role("prefill")
        self.decode_model = profile.for_role("decode")
        self.rng = random.Random(config.seed)

    def near_best(self, ranked: Sequence[T], predicted: Callable[[T], float], slo_s: float) -> T:
        """The first of `ranked` (best first), or with `choice_tolerance`, one drawn at random among those
        predicted within that share of it, and within `slo_s` when it is."""
        if self.config.choice_tolerance <= 0:
            return ranked[0]
        best = predicted(ranked[0])
        bound = best * (1 + self.config.choice_tolerance)
        if best <= slo_s:
            bound = min(bound, slo_s)
        near = [x for x in ranked if predicted(x) <= bound]
        return self.rng.choice(near) if len(near) > 1 else ranked[0]

    # --- predictions ------------------------------------------------------------------------------

    def slowdown(self, r: ReplicaSnapshot, model: LatencyModel) -> float:
        cfg = self.config
        if not cfg.calibrate_step_times or not r.recent_step_time_s or not r.recent_step_tokens:
            return 1.0
        tokens = round(r.recent_step_tokens)
        if r.role == "prefill":
            predicted = model.prefill_time_s(tokens)
        else:
            decodes = min(r.num_running, tokens)
            # the state the step times were measured in: the stats' own context, without pending placements
            measured_context = r.context_tokens - r.pending_blocks * r.block_size
            predicted = model.mixed_step_s(decodes, measured_context, tokens - decodes)
        if predicted <= 0:
            return 1.0
        low, high = cfg.slowdown_bounds
        return min(max(r.recent_step_time_s / predicted, low), high)

    def _options(
        self, request: PlacementRequest, replicas: Sequence[ReplicaSnapshot], model: LatencyModel
    ) -> list[_Option]:
        """Fresh replicas only, unless none is fresh: then all of them, penalised."""
        fresh = [r for r in replicas if r.age_s <= self.config.max_stats_age_s]
        penalty = 1.0 if fresh else self.config.stale_penalty
        options = []
        transport, most = self.config.kvstore_transport, request.num_prompt_tokens - 1
        for r in fresh or replicas:
            local = min(prefix_hit_tokens(request.block_hashes, r.prefix_hashes, r.block_size), most)
            credit, pull = local, 0.0
            stored = min(request.kvstore_hit_tokens, most)
            if stored > local and is_pull_faster(model, transport, stored - local, local):
                credit, pull = stored, pull_s(model, transport, stored - local)
            options.append(_Option(r, penalty * self.slowdown(r, model), credit, local, pull))
        return options

    def chunk_budget(
        self, request: PlacementRequest, o: _Option, model: LatencyModel, decodes: int
    ) -> tuple[int, bool]:
        """(chunk tokens, whether a chunk step keeps `decodes` running sequences within the TPOT SLO)."""
        bs, cap = o.replica.block_size, o.replica.max_num_batched_tokens
        chunk = largest_chunk(lambda c: o.scale * model.prefill_time_s(c),
                              self.config.chunk_ttft_fraction * request.ttft_slo_s, bs, cap)
        if decodes == 0:
            return chunk, True
        ctx = o.replica.context_tokens

        def step(c: int) -> float:
            return o.scale * model.mixed_step_s(decodes, ctx, c)

        chunk = min(chunk, largest_chunk(step, request.tpot_slo_s, bs, cap))
        return chunk, step(chunk) <= request.tpot_slo_s

    def prefill_s(
        self, request: PlacementRequest, o: _Option, model: LatencyModel, chunk: int, decodes: int
    ) -> float:
        """Time to the first token: the queue ahead, then this prompt; `chunk` tokens a step, beside
        `decodes` running sequences."""
        r, ctx = o.replica, o.replica.context_tokens
        queued = r.queued_prefill_tokens + r.pending_prefill_tokens
        full, rest = divmod(queued, chunk)
        total = full * model.mixed_step_s(decodes, ctx, chunk)
        if rest:
            total += model.mixed_step_s(decodes, ctx, rest)
        done = o.credit
        while done < request.num_prompt_tokens:
            n = min(chunk, request.num_prompt_tokens - done)
            total += model.mixed_step_s(decodes, ctx, n, done)
            done += n
        return o.scale * total + o.pull_s

    def tpot_s(self, request: PlacementRequest, o: _Option) -> float:
        """Decode step with this request in the batch; it is counted at half its output (its mean context)."""
        r = o.replica
        batch = r.num_running + r.num_waiting + r.num_pending + 1
        context = (r.context_tokens + r.queued_prefill_tokens + r.pending_prefill_tokens
                   + request.num_prompt_tokens + request.max_tokens // 2)
        return o.scale * self.decode_model.decode_step_s(batch, context)

    @staticmethod
    def has_room(request: PlacementRequest, o: _Option, tokens: int) -> bool:
        r = o.replica
        bs = r.block_size
        hit_blocks = o.local_hit // bs  # kvstore hits still need blocks here
        needed = -(-tokens // bs) - hit_blocks
        waiting = -(-(r.queued_prefill_tokens + r.pending_prefill_tokens) // bs)
        return needed <= r.num_free_blocks - r.pending_blocks - waiting

    # --- the policy -------------------------------------------------------------------------------

    def choose(self, request, prefill, decode):
        cfg = self.config
        d_options = self._options(request, decode, self.decode_model)
        total = request.num_prompt_tokens + request.max_tokens
        roomy = [o for o in d_options if self.has_room(request, o, total)]
        if not roomy:
            if cfg.admission == "reject":
                return Rejection("kv_full", cfg.min_retry_after_s)
            o = min(d_options, key=lambda o: (-_free(o.replica), o.replica.replica_id))
            return self._split(request, o, prefill, "kv_full", None, ())
        ranked = self.rank_decode(request, roomy, prefill)
        candidates = tuple(c for _, _, c in ranked)
        tpot, best, _ = self.pick_decode(request, ranked)
        if tpot <= request.tpot_slo_s:
            return self._split(request, best, prefill, None, tpot, candidates)
        if cfg.admission == "reject" and tpot > cfg.reject_factor * request.tpot_slo_s:
            return Rejection("tpot", cfg.min_retry_after_s)
        return self._split(request, best, prefill, "tpot", tpot, candidates)

    def rank_decode(
        self, request: PlacementRequest, roomy: Sequence[_Option], prefill: Sequence[ReplicaSnapshot]
    ) -> list[tuple[float, _Option, Candidate]]:
        """Decode options with room, best first, each with its predicted TPOT: here the lowest TPOT (ties:
        the most free blocks, then the replica id)."""
        scored = sorted(((self.tpot_s(request, o), o) for o in roomy),
                        key=lambda t: (t[0], -_free(t[1].replica), t[1].replica.replica_id))
        return [(t, o, Candidate(o.replica.replica_id, "decode", "tpot", t)) for t, o in scored]

    def pick_decode(
        self, request: PlacementRequest, ranked: list[tuple[float, _Option, Candidate]]
    ) -> tuple[float, _Option, Candidate]:
        return self.near_best(ranked, lambda t: t[0], request.tpot_slo_s)

    def _split(
        self, request: PlacementRequest, d: _Option, prefill: Sequence[ReplicaSnapshot], over: str | None,
        tpot: float | None, candidates: tuple[Candidate, ...],
    ) -> Placement | Rejection:
        """Steps 2 and 3 for the chosen decode replica `d`; `over` names an SLO it already misses."""
        decodes = d.replica.num_running + d.replica.num_pending
        chunk, interference_ok = self.chunk_budget(request, d, self.decode_model, decodes)
        local = Placement(
            disaggregate=False, prefill_replica=None, decode_replica=d.replica.replica_id,
            reason="local_prefix_hit" if d.credit else "local",
            predicted_ttft_s=self.prefill_s(request, d, self.decode_model, chunk, decodes),
            predicted_tpot_s=tpot,
            candidates=candidates, prefill_chunk_tokens=min(chunk, request.num_prompt_tokens),
            priority=request.priority,
        )
        if not prefill:
            return self._admit(request, _replace(local, reason=self.local_reason), over, interference_ok)
        if local.predicted_ttft_s <= request.ttft_slo_s and interference_ok:
            return self._admit(request, local, over, True)
        remote = self._remote(request, prefill, local)
        if remote is None:
            return self._admit(request, local, over, interference_ok)
        if remote.predicted_ttft_s <= request.ttft_slo_s or not interference_ok:
            return self._admit(request, remote, over, True)
        # neither meets TTFT: the earlier first token is the least bad
        best = local if local.predicted_ttft_s < remote.predicted_ttft_s else remote
        return self._admit(request, best, over, True)

    def _remote(
        self, request: PlacementRequest, prefill: Sequence[ReplicaSnapshot], local: Placement
    ) -> Placement | None:
        """`local` with its prefill moved to the replica with the earliest first token; None: all full."""
        scored = self._remote_scores(request, prefill)
        if not scored:
            return None
        ttft, _, replica_id, chunk = self.near_best(scored, lambda t: t[0], request.ttft_slo_s)
        return _replace(
            local, disaggregate=True, prefill_replica=replica_id, reason="disaggregated",
            predicted_ttft_s=ttft,
            candidates=local.candidates + tuple(Candidate(r, "prefill", "ttft", t) for t, _, r, _ in scored),
            prefill_chunk_tokens=min(chunk, request.num_prompt_tokens),
        )

    def _remote_scores(
        self, request: PlacementRequest, prefill: Sequence[ReplicaSnapshot]
    ) -> list[tuple[float, int, str, int]]:
        """(predicted first token incl. the KV transfer, -free blocks, replica id, chunk) for each prefill
        replica with room, earliest first."""
        model, transport = self.prefill_model, self.config.transport
        transfer = 0.0 if transport is None else model.kv_transfer_s(request.num_prompt_tokens, transport)
        scored = []
        for o in self._options(request, prefill, model):
            if not self.has_room(request, o, request.num_prompt_tokens):
                continue  # a full pool
            chunk, _ = self.chunk_budget(request, o, model, 0)
            ttft = self.prefill_s(request, o, model, chunk, 0) + transfer
            scored.append((ttft, -_free(o.replica), o.replica.replica_id, chunk))
        return sorted(scored)

    def _admit(
        self, request: PlacementRequest, p: Placement, over: str | None, interference_ok: bool
    ) -> Placement | Rejection:
        """Admission control on the chosen placement: as is, flagged over SLO, or rejected."""
        ttft_ok = p.predicted_ttft_s <= request.ttft_slo_s
        checks = ((over, over is None), ("ttft", ttft_ok), ("tpot_interference", interference_ok))
        misses = [m for m, ok in checks if not ok]
        if not misses:
            return p
        cfg = self.config
        too_late = p.predicted_ttft_s > cfg.reject_factor * request.ttft_slo_s
        if not ttft_ok and cfg.admission == "reject" and too_late:
            return Rejection("ttft", max(cfg.min_retry_after_s, p.predicted_ttft_s - request.ttft_slo_s))
        return _replace(p, reason=f"{p.reason}:over_slo:{','.join(misses)}", meets_slo=False)


def _free(r: ReplicaSnapshot) -> int:
    return r.num_free_blocks - r.pending_blocks


def _replace(p: Placement, **changes) -> Placement:
    return dataclasses.replace(p, **changes)
