"""Per-request state: tokens, KV progress and block table."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from pdserve.sampling_params import SamplingParams
from pdserve.structured import Matcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class OutputTokens:
    """What the sampler reads of a row's tokens, over `token_ids`, `num_prompt_tokens` and `num_resumed_tokens`
    (a Sequence, or a draft row's view of one)."""

    __slots__ = ()
    token_ids: list[int]
    num_prompt_tokens: int
    num_resumed_tokens: int
    grammar: Matcher | None = None  # a draft row's view holds its grammar's mask at that row's position

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def penalized_token_ids(self) -> list[int]:
        """Output ids for presence/frequency penalties: this engine's output and any resumed output."""
        return self.token_ids[self.num_prompt_tokens - self.num_resumed_tokens :]


@dataclass(eq=False)  # identity semantics: the scheduler's queues hold and remove exact objects
class Sequence(OutputTokens):
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    block_size: int
    eos_token_ids: frozenset[int] = frozenset()
    # prefill_only: stop after the first token and keep the KV blocks under a lease.
    prefill_only: bool = False
    priority: int = 0
    max_prefill_chunk: int | None = None
    kv_part_tokens: int | None = None  # prefill-only: lease full blocks in parts of this many tokens
    num_parted_blocks: int = 0  # leading blocks already handed out as parts
    arrival_time: float = field(default_factory=time.monotonic)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    # chained hashes of the full blocks already registered in the prefix cache
    block_hashes: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    first_scheduled_time: float | None = None
    num_prefill_chunks: int = 0  # engine steps that ran part of this prompt
    num_deltas: int = 0  # TokenDeltas emitted (an adopted sequence starts past its first token)
    num_draft_tokens: int = 0  # speculative decoding: drafted, accepted, verification steps
    num_accepted_tokens: int = 0
    num_verifications: int = 0
    num_resumed_tokens: int = 0  # trailing prompt tokens that are earlier output (penalties count them)
    draft_limit: int | None = None  # adaptive cap on the next draft's length (None: the configured k)
    # (logprob of prompt token i, its top alternatives) for i < len(list); position 0 has neither.
    # None: not asked for, or computed elsewhere (an adopted sequence: the prefill engine has them).
    prompt_logprobs: list[tuple[float | None, tuple[tuple[int, float], ...] | None]] | None = None
    # response_format's grammar state, advanced over every output token (None: unconstrained)
    grammar: Matcher | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [(None, None)]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_uncomputed_tokens == 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_full_blocks(self) -> int:
        return self.num_computed_tokens // self.block_size

    def block_tokens(self, index: int) -> list[int]:
        return self.token_ids[index * self.block_size : (index + 1) * self.block_size]

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size
