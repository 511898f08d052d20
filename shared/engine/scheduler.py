"""Iteration-level scheduler: decodes first, then prefill chunks fill the per-step token budget.

When the KV pool runs out, the newest running sequence is preempted by recompute: its blocks
are freed and it goes back to the front of the waiting queue with its generated tokens kept.
With a drafter, a decode may also carry draft tokens to verify; drafts take only the budget and
free blocks left after every decode and prefill (they never preempt or delay other work).
"""

from __future__ import annotations

import time

from collections import deque
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.spec.drafter import Drafter


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk tokens)
    preempted: list[Sequence] = field(default_factory=list)
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)  # decodes verifying draft tokens

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(len(d) for d in self.drafts.values()) + sum(n for _, n in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, drafter: Drafter | None = None) -> None:
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs, or prefills could starve")
        self.config = config
        self.block_manager = block_manager
        self.drafter = drafter
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def queued_prefill_tokens(self) -> int:
        return sum(s.num_uncomputed_tokens for s in self.waiting) + sum(
            s.num_uncomputed_tokens for s in self.running if not s.is_decoding
        )

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        # Lower priority value first; FIFO within a class.
        if not self.waiting or self.waiting[-1].priority <= seq.priority:
            self.waiting.append(seq)
            return
        index = next(i for i, s in enumerate(self.waiting) if s.priority > seq.priority)
        self.waiting.insert(index, seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose KV is already in the pool (adopted from a lease)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()
        # 1. decodes, oldest first
        for seq in list(self.running):
            if budget == 0 or len(batch.decodes) >= self.config.max_num_seqs:
                break
            if seq.status != SequenceStatus.RUNNING or not seq.is_decoding:
                continue
            if self._grow_or_preempt(seq, len(seq), batch, scheduled):
                batch.decodes.append(seq)
                scheduled.add(id(seq))
                budget -= 1
        # 2. prefill chunks of running sequences, then new admissions
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING or seq.is_decoding or id(seq) in scheduled:
                continue
            num_new = self._chunk_size(seq, budget, batch)
            if num_new and self._grow_or_preempt(seq, seq.num_computed_tokens + num_new, batch, scheduled):
                batch.prefills.append((seq, num_new))
                scheduled.add(id(seq))
                budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            # A prefix-cache hit skips computing its rows, and prompt logprobs need every row: a sequence
            # still owing them computes its whole prompt.
            if not seq.block_table and not seq.wants_prompt_logprobs:
                seq.num_computed_tokens = seq.num_cached_tokens = self.block_manager.match_prefix(seq)
            num_new = self._chunk_size(seq, budget, batch)
            # Admit only if the whole remaining prompt fits, so admissions never deadlock the pool.
            if not num_new or not self.block_manager.can_allocate(self.block_manager.num_blocks_to_grow(seq, len(seq))):
                self._reset(seq)
                break
            self.block_manager.grow(seq, seq.num_computed_tokens + num_new)
            self.block_manager.record_prefix_lookup(len(seq), seq.num_cached_tokens)
            self.waiting.popleft()
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.prefills.append((seq, num_new))
            scheduled.add(id(seq))
            budget -= num_new
        # 3. drafts for the scheduled decodes, from the budget and free blocks everything else left
        if self.drafter is not None and self.drafter.is_enabled(len(self.running)):
            for seq in batch.decodes:
                draft = self.drafter.draft(seq, budget)
                if draft and self.block_manager.grow_speculative(seq, len(seq) + len(draft)):
                    batch.drafts[seq] = draft
                    budget -= len(draft)
        return batch

    def _chunk_size(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        remaining = seq.num_uncomputed_tokens
        if seq.max_prefill_chunk is not None:
            budget = min(budget, seq.max_prefill_chunk)
        if self.config.enable_chunked_prefill or seq.max_prefill_chunk is not None:
            return min(remaining, budget)
        if remaining <= budget or (remaining > self.config.max_num_batched_tokens and batch.is_empty):
            return remaining  # an oversized prompt runs alone rather than never
        return 0

    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch, scheduled: set[int]) -> bool:
        while not self.block_manager.grow(seq, num_tokens):
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled), None)
            if victim is None:
                return False
            self.preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._reset(seq)
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _reset(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def finish(self, seq: Sequence, reason: str) -> None:
        self.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq.block_table:
            self.block_manager.free(seq)
