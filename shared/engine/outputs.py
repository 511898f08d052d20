"""Engine request and output types (plain data, no tensors)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdserve.engine.step_clock import StepTotals
from pdserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class KVHandoff:
    """KV blocks held under a lease: produced by prefill-only runs, consumed by adoption."""

    lease_id: str
    block_ids: tuple[int, ...]
    num_tokens: int  # tokens whose K/V are in the blocks
    block_hashes: tuple[int, ...] = ()
    first_block: int = 0  # a part (kv_part_tokens): its first block's index in the prompt
    num_parted_blocks: int = 0  # the final handoff after parts: leading blocks already sent as parts


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0
    # Stop after the first token and hold the KV under a lease (prefill worker).
    prefill_only: bool = False
    # Continue from KV already in this engine's pool (lease id) with this first token.
    adopt_lease_id: str | None = None
    first_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Cap on this prompt's tokens per step (the router's chunk budget); None: the engine's budget.
    max_prefill_chunk: int | None = None
    # Seeded noise draws already made for this request elsewhere (one per token in the prompt's resumed
    # tail); skipped at admission, as is the draw of an adopted first_token_id.
    rng_offset: int = 0
    # Trailing prompt tokens that are output already sent (a migrated stream or a local fallback): penalties
    # count them as output, and the detokenizer replays them so held text (a partial character) carries on.
    num_resumed_tokens: int = 0
    # prefill-only: hand the prompt's full blocks over in parts of this many tokens (rounded up to whole
    # blocks; chunks are capped to it) as they are computed, each on its own lease (TokenDelta.kv_part)
    kv_part_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(int(t) for t in self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if not 0 <= self.num_resumed_tokens < len(self.prompt_token_ids):
            raise ValueError("num_resumed_tokens must be in [0, prompt length)")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError("max_prefill_chunk must be at least 1")
        if (self.adopt_lease_id is None) != (self.first_token_id is None):
            raise ValueError("adopt_lease_id and first_token_id go together")
        if self.prefill_only and self.adopt_lease_id is not None:
            raise ValueError("a request cannot both prefill-only and adopt KV")
        if self.kv_part_tokens is not None and (self.kv_part_tokens < 1 or not self.prefill_only):
            raise ValueError("kv_part_tokens needs a prefill-only request and at least 1 token")


@dataclass(frozen=True)
class TokenDelta:
    request_id: str
    token_ids: tuple[int, ...]  # new tokens this step
    text: str  # new committed text this step
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    stop_reason: str | int | None = None  # matched stop string or stop token id
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    kv_handoff: KVHandoff | None = None
    kv_part: KVHandoff | None = None  # leading blocks leased while the prompt is still being computed (no token)
    queue_time_s: float | None = None  # arrival to first scheduled, on the first token's delta only
    num_prefill_chunks: int = 0
    # on the first token's delta when SamplingParams.prompt_logprobs is set: one entry per prompt token,
    # the first None (nothing precedes it)
    prompt_logprobs: tuple[float | None, ...] | None = None
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None
    # speculative decoding so far in this request (cumulative): drafted, accepted, verification steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0


@dataclass(frozen=True)
class EngineStats:
    """Snapshot for routing decisions."""

    num_waiting: int
    num_running: int
    queued_prefill_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    num_leased_blocks: int
    recent_step_times_s: tuple[float, ...]
    recent_step_tokens: tuple[int, ...]
    prefix_hit_tokens: int
    prefix_queried_tokens: int
    num_preemptions: int
    num_expired_leases: int = 0
    max_num_batched_tokens: int = 2048  # per-step token budget: the largest prefill chunk a step takes
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_verifications: int = 0
    recent_step_gaps_s: tuple[float, ...] = ()  # step end -> next step start while requests stayed unfinished
    step_totals: StepTotals | None = None  # cumulative stepping time (pdserve.engine.step_clock)
