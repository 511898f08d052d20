"""Frozen settings of a simulated system: engines, routers, the cluster's shape, and one request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdserve.placement.policy import PlacementConfig

MODES = ("disaggregated", "colocated")
CORE_SHARING = ("step", "continuous")  # ClusterSpec.core_sharing


@dataclass(frozen=True)
class EngineSpec:
    """One replica's engine: the live SchedulerConfig / CacheConfig fields the model needs."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget: decodes (1 each) + prefill chunks
    enable_chunked_prefill: bool = True
    num_blocks: int = 4096
    block_size: int = 16
    enable_prefix_caching: bool = True
    recent_steps: int = 8  # steps averaged into the stats' recent step time and tokens
    num_threads: int = 1  # cores a step keeps busy (the live worker: max(1, int(num_cpus)))
    # False: a request reaching the replica while a step runs is absent from its stats until the step ends,
    # as in the live engine before commit 302a9c5 (it waited for the step's lock unseen)
    stats_count_arriving: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_blocks", "block_size", "recent_steps",
                     "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs, or prefills could starve")


@dataclass(frozen=True)
class RouterSpec:
    num_routers: int = 1
    pending_grace_s: float = 0.05  # PendingPlacements.grace_s
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    ttft_slo_s: float = 2.0  # the SLOs placement targets (the router's slo_ttft_s / slo_tpot_s)
    tpot_slo_s: float = 0.2
    # the router reads the latency profile (router.profile_path); without one, slo_aware falls back to
    # least_loaded, as the live placer does
    has_profile: bool = True
    # where the polls fall against the arrivals, in [0, 1) of a poll period: router k first polls at
    # (k + poll_phase) / num_routers periods (a live router's timer starts at an arbitrary moment)
    poll_phase: float = 0.0
    # a disaggregated prompt longer than this is prefilled in chunks of this many tokens and its KV handed over
    # in parts as they are computed (the router's kv_part_tokens, pdserve.sim.handoff); None: in one piece
    kv_part_tokens: int | None = 256

    def __post_init__(self) -> None:
        if self.num_routers < 1 or self.pending_grace_s < 0:
            raise ValueError("num_routers >= 1 and pending_grace_s >= 0")
        if self.kv_part_tokens is not None and self.kv_part_tokens < 1:
            raise ValueError(f"kv_part_tokens must be >= 1 or None, got {self.kv_part_tokens}")
        if not 0.0 <= self.poll_phase < 1.0:
            raise ValueError(f"poll_phase must be in [0, 1), got {self.poll_phase}")

    @property
    def poll_s(self) -> float:
        """Each router polls every replica's stats this often."""
        return self.placement.stats_poll_period_s


@dataclass(frozen=True)
class ClusterSpec:
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    num_prefill: int = 1  # ignored when colocated
    num_decode: int = 1  # colocated: the engines that prefill and decode
    prefill: EngineSpec = field(default_factory=EngineSpec)
    decode: EngineSpec = field(default_factory=EngineSpec)
    router: RouterSpec = field(default_factory=RouterSpec)
    transport: str = "ucx"  # the profile's transfer model for the KV handoff; absent there: free
    startup_s: float = 60.0  # a replica the autoscaler adds serves this long after it is asked for
    # cores every replica shares (one host). None: each replica has its own machine
    num_cores: float | None = None
    # how steps share them: "step", a step starting while others run takes max(1, demand / num_cores) times
    # its profiled time, fixed for its length; "continuous", every step in flight progresses at
    # min(1, num_cores / demand), recomputed as steps start and end (pdserve.sim.host.SharedCores)
    core_sharing: Literal["step", "continuous"] = "step"
    # CPU seconds a replica spends per generated token outside its steps (pdserve.sim.host), on those cores
    off_step_cpu_token_s: float = 0.0
    # and what the rest of the host burns there: per generated token (Serve proxy, router, load client), and
    # all the time (Ray's processes, idle loops), in cores
    serving_cpu_token_s: float = 0.0
    background_cores: float = 0.0
    # "step" sharing, while the busy replicas' threads exceed num_cores: a step's slow-down beyond the fair
    # share, (a step with a prefill, a decode-only step), as measured (pdserve.loadtest.contention)
    oversubscribed_scale: tuple[float, float] = (1.0, 1.0)
    # the thread woken for a replica's next step waits this long for a core where every core is taken, so
    # each step starts wake_wait_s x (1 - 1/slow-down) late ("continuous": 1 - its first rate): the share of
    # time a runnable thread waits under processor sharing (pdserve.engine.step_clock measures the live gaps')
    wake_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.num_decode < 1 or (self.mode == "disaggregated" and self.num_prefill < 1):
            raise ValueError("need at least one decode replica, and one prefill replica when disaggregated")
        if self.startup_s < 0:
            raise ValueError("startup_s must be >= 0")
        if self.core_sharing not in CORE_SHARING:
            raise ValueError(f"core_sharing must be one of {CORE_SHARING}, got {self.core_sharing!r}")
        if self.num_cores is not None and not self.num_cores > 0:
            raise ValueError(f"num_cores must be > 0, got {self.num_cores}")
        for name in ("off_step_cpu_token_s", "serving_cpu_token_s", "background_cores", "wake_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if len(self.oversubscribed_scale) != 2 or not all(s > 0 for s in self.oversubscribed_scale):
            raise ValueError(f"oversubscribed_scale must be two factors > 0, got {self.oversubscribed_scale}")


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...] = ()  # chained hashes of the prompt's full engine blocks, in order

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError("a request has at least one prompt token and one output token")
