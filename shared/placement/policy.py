"""Placement: which prefill and decode replica serve a request, as a pure function of stats snapshots.

Policies sit behind `PlacementPolicy` and are built by name from `POLICIES` (`create_policy`):
`round_robin` and `least_loaded` here, `slo_aware` (the default) in `slo_aware.py`, `kv_aware` in
`kv_aware.py`. No Ray, no I/O,
no torch: the router builds the snapshots and owns the policy object (round-robin keeps its counter).

One path for every policy: the topology is resolved once, when the policy is built (colocated means
no prefill pool, so `prefill` is always empty and no policy looks at a mode); `place` always returns
a `Placement` or a `Rejection`, and before any decode replica has reported stats it places by the
prompt-length rule and leaves the replicas to Serve. The prompt-length rule (`prefill_split`) lives
here only; each replica's chunk cap is the token budget it reports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.api.contract import Priority
from pdserve.latency_model import LatencyProfile
from pdserve.registry import load


@dataclass(frozen=True)
class ReplicaSnapshot:
    """One replica's last reported stats, plus what the router placed there since (`*pending*`)."""

    replica_id: str
    role: str  # "prefill" | "decode"
    age_s: float  # time since the stats were taken
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    max_num_batched_tokens: int = 2048  # the engine's per-step token budget: the largest prefill chunk
    recent_step_time_s: float | None = None  # mean of the recent steps
    recent_step_tokens: float | None = None  # mean tokens per recent step (decodes + prefill chunks)
    num_context_tokens: int | None = None  # None: estimated from the used blocks
    # block hashes cached on the replica (the router's prefix index, read within one placement); None: unknown
    prefix_hashes: Container[int] | None = None
    num_pending: int = 0
    pending_prefill_tokens: int = 0
    pending_blocks: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def context_tokens(self) -> int:
        known = self.num_context_tokens
        if known is None:
            known = self.num_used_blocks * self.block_size
        return known + self.pending_blocks * self.block_size

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting + self.num_pending

    @classmethod
    def from_stats(
        cls, replica_id: str, role: str, age_s: float, stats: Any, **extra: Any
    ) -> ReplicaSnapshot:
        """From an `EngineStats` (duck-typed, so this module stays torch-free)."""
        times, tokens = tuple(stats.recent_step_times_s), tuple(stats.recent_step_tokens)
        return cls(
            replica_id=replica_id, role=role, age_s=age_s, num_running=stats.num_running,
            num_waiting=stats.num_waiting, queued_prefill_tokens=stats.queued_prefill_tokens,
            num_free_blocks=stats.num_free_blocks, num_total_blocks=stats.num_total_blocks,
            block_size=stats.block_size,
            max_num_batched_tokens=getattr(stats, "max_num_batched_tokens", cls.max_num_batched_tokens),
            recent_step_time_s=sum(times) / len(times) if times else None,
            recent_step_tokens=sum(tokens) / len(tokens) if tokens else None,
            **extra,
        )


@dataclass(frozen=True)
class PlacementRequest:
    num_prompt_tokens: int
    max_tokens: int
    ttft_slo_s: float
    tpot_slo_s: float
    priority: Priority = Priority.INTERACTIVE
    block_hashes: tuple[int, ...] = ()  # chained hashes of the prompt's full blocks, in order
    kvstore_hit_tokens: int = 0  # prompt tokens whose KV the kvstore holds

    def __post_init__(self) -> None:
        if self.num_prompt_tokens <= 0 or self.max_tokens <= 0:
            raise ValueError("a request has at least one prompt token and one output token")
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("SLOs must be positive")


class Candidate(NamedTuple):
    replica_id: str
    role: str
    metric: str  # "ttft" | "tpot"
    predicted_s: float


@dataclass(frozen=True)
class Placement:
    disaggregate: bool
    prefill_replica: str | None  # None: the decode replica prefills (or, disaggregated, Serve picks)
    decode_replica: str | None  # None: Serve picks (no stats yet)
    reason: str
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    candidates: tuple[Candidate, ...] = ()
    # Per-step cap on this request's prefill chunk (tokens); None: the engine's token budget.
    prefill_chunk_tokens: int | None = None
    priority: Priority = Priority.INTERACTIVE  # the request's, passed to the engine
    meets_slo: bool = True
    # on the replica that prefills: prompt tokens expected cached there (its own pool, or pulled), and the
    # leading blocks it takes from the Redis tier where its pool misses (0: none)
    prefix_hit_tokens: int = 0
    prefix_pull_blocks: int = 0


@dataclass(frozen=True)
class Rejection:
    """Admission control: answer 429 with Retry-After."""

    reason: str  # "kv_full" | "tpot" | "ttft"
    retry_after_s: float


class PlacementConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str = "slo_aware"
    # the prompt-length rule (round_robin, least_loaded, and every policy before stats arrive): prompts
    # shorter than this prefill on the decode replica
    disaggregate_min_prompt_tokens: int = Field(32, ge=0)
    # stats older than this are unknown: skipped while a fresh replica exists, else used with the penalty
    max_stats_age_s: float = Field(5.0, gt=0)
    stats_poll_period_s: float = Field(0.1, gt=0)  # how often the router asks each replica for its stats
    stale_penalty: float = Field(2.0, ge=1)
    # when no placement meets the SLOs: "reject" answers 429 once the least-bad prediction exceeds
    # reject_factor x the SLO; "queue" always places (flagged meets_slo=False)
    admission: Literal["reject", "queue"] = "reject"
    reject_factor: float = Field(1.0, ge=1)
    min_retry_after_s: float = Field(1.0, ge=0)
    transport: str | None = None  # KV handoff transport; None: transfer time not modelled
    kvstore_transport: str | None = "redis"  # how kvstore prefix hits are pulled (a profile transfer model)
    kvstore_timeout_s: float = Field(0.25, gt=0)  # a slower kvstore lookup counts as a miss
    # the prefix index: a replica whose KV events are older than this is unknown (no prefix credit); blocks
    # placed on a replica count as held there for prefix_expect_s, until its events show them
    prefix_max_age_s: float = Field(1.0, gt=0)
    prefix_expect_s: float = Field(10.0, ge=0)
    # kv_aware without a latency profile: replicas within this many requests of the least loaded one
    # compete on the longest cached prefix
    kv_aware_load_slack: int = Field(2, ge=0)
    # kv_aware with a latency profile: a replica whose predicted TTFT and TPOT are both within this share
    # of the SLOs is comfortable; among comfortable replicas the longest cached prefix wins (the least
    # prefill work, which is capacity), and load only decides once a replica's predictions leave it
    kv_aware_slo_headroom: float = Field(0.5, gt=0, le=1)
    # a prefill chunk step takes at most this share of the request's TTFT SLO, so requests behind a
    # long prompt wait at most about one chunk
    chunk_ttft_fraction: float = Field(0.25, gt=0, le=1)
    # scale predictions by measured/predicted recent step time, clamped to these bounds
    calibrate_step_times: bool = True
    slowdown_bounds: tuple[float, float] = (0.5, 8.0)
    # slo_aware: choose at random among the replicas predicted within this share of the best (and within the
    # SLO when the best is), so that routers whose views lag each other do not all pick the same replica;
    # 0: always the best
    choice_tolerance: float = Field(0.2, ge=0, le=1)
    seed: int | None = None  # the random choice's seed; None: from the OS (routers must not share one)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name not in POLICIES:
            raise ValueError(f"unknown placement policy {name!r}; known: {sorted(POLICIES)}")
        return name


class PlacementPolicy(ABC):
    """Chooses the replicas of one request from stats snapshots. `has_prefill_pool` is the topology:
    False (colocated) means `prefill` is always empty."""

    name: ClassVar[str]

    def __init__(
        self, config: PlacementConfig, profile: LatencyProfile | None = None, has_prefill_pool: bool = True,
    ) -> None:
        self.config = config
        self.profile = profile
        self.has_prefill_pool = has_prefill_pool

    def place(
        self, request: PlacementRequest, prefill: Sequence[ReplicaSnapshot], decode: Sequence[ReplicaSnapshot]
    ) -> Placement | Rejection:
        if not decode:  # no stats yet: the prompt-length rule, and Serve's choice of replicas
            split, reason = self.prefill_split(request, self.has_prefill_pool)
            return Placement(split, None, None, reason, priority=request.priority)
        return self.choose(request, prefill, decode)

    @abstractmethod
    def choose(
        self, request: PlacementRequest, prefill: Sequence[ReplicaSnapshot], decode: Sequence[ReplicaSnapshot]
    ) -> Placement | Rejection:
        """`place` once at least one decode replica has reported stats."""

    @property
    def local_reason(self) -> str:
        """Why a request prefills on its decode replica when there is no prefill replica to take it."""
        return "no_prefill_pool" if self.has_prefill_pool else "colocated"

    def prefill_split(self, request: PlacementRequest, has_prefill: bool) -> tuple[bool, str]:
        """The prompt-length rule: (prefill on a prefill replica?, reason)."""
        if not has_prefill:
            return False, self.local_reason
        if request.num_prompt_tokens < self.config.disaggregate_min_prompt_tokens:
            return False, "short_prompt"
        return True, "long_prompt"

    def _simple(
        self, request: PlacementRequest, prefill: ReplicaSnapshot | None, decode: ReplicaSnapshot
    ) -> Placement:
        """The SLO-blind policies: the prompt-length rule on the chosen replicas."""
        split, reason = self.prefill_split(request, prefill is not None)
        return Placement(
            disaggregate=split, prefill_replica=prefill.replica_id if split else None,
            decode_replica=decode.replica_id, reason=reason,  # the policy is a span attribute
            priority=request.priority,
        )


class RoundRobin(PlacementPolicy):
    name = "round_robin"

    def __init__(
        self, config: PlacementConfig, profile: LatencyProfile | None = None, has_prefill_pool: bool = True,
    ) -> None:
        super().__init__(config, profile, has_prefill_pool)
        self.counter = 0  # requests placed so far: the next index into each pool

    def choose(self, request, prefill, decode):
        i = self.counter
        self.counter += 1
        ordered_p, ordered_d = _by_id(prefill), _by_id(decode)
        return self._simple(request, ordered_p[i % len(ordered_p)] if ordered_p else None,
                            ordered_d[i % len(ordered_d)])


class LeastLoaded(PlacementPolicy):
    name = "least_loaded"

    def choose(self, request, prefill, decode):
        def key(r: ReplicaSnapshot) -> tuple:
            return r.load, -(r.num_free_blocks - r.pending_blocks), r.replica_id

        best_prefill = min(prefill, key=key) if prefill else None
        return self._simple(request, best_prefill, min(decode, key=key))


def _by_id(replicas: Sequence[ReplicaSnapshot]) -> list[ReplicaSnapshot]:
    return sorted(replicas, key=lambda r: r.replica_id)


POLICIES: dict[str, str] = {
    "round_robin": "pdserve.placement.policy:RoundRobin",
    "least_loaded": "pdserve.placement.policy:LeastLoaded",
    "slo_aware": "pdserve.placement.slo_aware:SloAware",
    "kv_aware": "pdserve.placement.kv_aware:KvAware",
}


def policy_class(name: str) -> type[PlacementPolicy]:
    return load(POLICIES, name, "placement policy")


def create_policy(
    config: PlacementConfig, profile: LatencyProfile | None = None, has_prefill_pool: bool = True,
) -> PlacementPolicy:
    return policy_class(config.policy)(config, profile, has_prefill_pool)
