"""The contract between the router and the workers: what a prefill or decode call takes and returns.

Frozen, typed, torch-free: the router (which must not import torch) and the workers import the same
types. Ray carries them between deployments; tensors never travel here (KV bytes go over the KV
transport, described by `HandoffParams`).

Lifecycle of a disaggregated request:
    router  -> prefill.prefill(WorkerRequest)                -> PrefillResult(first: TokenBatch, handoff)
    router  -> decode.generate(WorkerRequest, handoff, first) -> stream of DecodeEvent
A request without a handoff goes to decode.generate alone (local prefill). `WorkerRequest.replica`
names the replica placement chose; the worker deployments' request router sends the call there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any, TypeVar

from pdserve.sampling_params import SamplingParams


class Priority(IntEnum):
    """Request priority class; the engine runs lower values first."""

    INTERACTIVE = 0
    BATCH = 1

    @classmethod
    def of(cls, name: str) -> Priority:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown priority class {name!r}; known: {[p.name.lower() for p in cls]}") from None


@dataclass(frozen=True)
class HandoffParams:
    """Where and how a decode worker pulls a request's KV (like vLLM's `kv_transfer_params`)."""

    transport: str  # registry name: "ucx" | "redis" | "local" | "shm"
    layout_hash: int
    lease_id: str  # the prefill side's lease on the blocks
    num_tokens: int  # tokens whose K/V the blocks hold
    block_ids: tuple[int, ...]  # block ids in the prefill pool, in sequence order
    block_hashes: tuple[int, ...] = ()  # chained hashes of the full blocks (content addresses)
    address: str | None = None  # peer host for point-to-point transports
    port: int | None = None
    # per-handoff secret the exporter checks (constant time) before serving a pull; "" where the transport
    # has none (redis: access is Redis AUTH). Never in repr, logs or spans.
    secret: str = field(default="", repr=False)
    # where an importer on the exporter's node may pull through shared memory instead (pdserve.kvcache.
    # transports.shm): the node's id (kernel boot, network namespace, user) and the exporter's socket name
    node_id: str | None = None
    local_address: str | None = None
    # the first block's index in the prompt's block sequence: > 0 for a KVPart after the first, and for the
    # tail of a handoff whose leading blocks went ahead as parts while prefill ran
    first_block: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        object.__setattr__(self, "block_hashes", tuple(int(h) for h in self.block_hashes))
        if self.num_tokens <= 0 or not self.block_ids:
            raise ValueError("a handoff carries at least one token and one block")
        if self.first_block < 0:
            raise ValueError("first_block must be non-negative")
        if len(self.block_hashes) > len(self.block_ids):
            raise ValueError("more block hashes than blocks")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HandoffParams:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown handoff fields {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True, slots=True)
class WorkerRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: Priority = Priority.INTERACTIVE
    max_prefill_chunk: int | None = None  # the router's per-step cap on this prompt; None: the engine's budget
    trace: Mapping[str, str] = field(default_factory=dict)  # W3C trace context of the caller's span
    replica: str | None = None  # the replica placement chose; None: the request router picks
    # leading prompt blocks to take from the Redis tier where the worker's pool misses them (placement found
    # them there and predicts the pull faster than the prefill); 0: none
    prefix_pull_blocks: int = 0
    # seeded noise draws this request already made on another engine (a migrated stream skips them, so
    # it continues the seeded sequence); 0: a fresh start
    rng_offset: int = 0
    # trailing prompt tokens that are this request's own output, already sent (a migrated stream): they
    # count as output for penalties and the detokenizer replays them, so text continues exactly
    num_resumed_tokens: int = 0
    # prefill hands the KV over in parts of about this many tokens while it runs (decode pulls each as it
    # comes, so only the last part is left when the first token is out); None: all at once at the end
    kv_part_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if not 0 <= self.num_resumed_tokens < len(self.prompt_token_ids):
            raise ValueError("num_resumed_tokens must be in [0, prompt length)")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError("max_prefill_chunk must be at least 1")
        if self.kv_part_tokens is not None and self.kv_part_tokens < 1:
            raise ValueError("kv_part_tokens must be at least 1")
        if self.prefix_pull_blocks < 0:
            raise ValueError("prefix_pull_blocks must be non-negative")
        if self.rng_offset < 0:
            raise ValueError("rng_offset must be non-negative")

    def to(self, replica: str | None) -> WorkerRequest:
        return dataclasses.replace(self, replica=replica)


R = TypeVar("R", bound=Any)


def resumed(request: R, sent: Sequence[int]) -> R:
    """`request` continued after `sent`, output tokens its client already has: they become the prompt's
    resumed tail, the token budget shrinks by as many, their seeded draws are skipped, and prompt logprobs
    (delivered already) are not computed again. For a WorkerRequest (a migrated stream) and the engine's
    GenerationRequest (a decode replica prefilling locally after a failed import) alike."""
    k, r = len(sent), request
    params = dataclasses.replace(r.params, max_tokens=r.params.max_tokens - k, prompt_logprobs=None,
                                 min_tokens=max(0, r.params.min_tokens - k))
    return dataclasses.replace(r, prompt_token_ids=(*r.prompt_token_ids, *sent), params=params,
                               rng_offset=r.rng_offset + k, num_resumed_tokens=r.num_resumed_tokens + k)


@dataclass(frozen=True, slots=True)
class TokenBatch:
    """Tokens a choice produced since the previous batch, with their text and logprobs."""

    token_ids: tuple[int, ...]
    text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None
    stop_reason: str | int | None = None  # matched stop string or stop token id
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # on a choice's first batch when prompt logprobs were asked: one entry per prompt token, the first None
    prompt_logprobs: tuple[float | None, ...] | None = None
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None

    @classmethod
    def of(cls, delta: Any) -> TokenBatch:
        """From an engine `TokenDelta` (duck-typed: this module stays torch-free)."""
        return cls(delta.token_ids, delta.text, delta.finished, delta.finish_reason, delta.stop_reason,
                   delta.logprobs, delta.top_logprobs, delta.num_prompt_tokens, delta.num_output_tokens,
                   delta.num_cached_tokens, delta.prompt_logprobs, delta.prompt_top_logprobs)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class FallbackNotice:
    """Decode could not import the handoff and prefills locally instead (counted and traced by decode)."""

    reason: str
    error: str | None = None


DecodeEvent = TokenBatch | FallbackNotice


@dataclass(frozen=True, slots=True)
class KVPart:
    """Leading blocks of a prompt's KV, exported under their own lease while prefill still runs
    (`params.first_block` places them); decode pulls them into the reservation it holds for the whole
    prompt (`num_prompt_tokens`)."""

    params: HandoffParams
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class PrefillResult:
    first: TokenBatch  # the first token; finished when the request ends with it
    handoff: HandoffParams | None  # None: nothing to pull (finished, or no KV left to hand off)
    replica: str  # the prefill replica that holds the lease


PrefillEvent = KVPart | PrefillResult
