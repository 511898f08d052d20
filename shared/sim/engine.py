"""One simulated engine replica, stepping like pdserve.engine.scheduler.Scheduler.

Each step: running decodes first (oldest first, one token each, up to max_num_seqs), then prefill chunks
of running sequences, then admissions from the waiting queue (FIFO; admitted only when the whole prompt's
blocks fit), all within max_num_batched_tokens. Without chunked prefill a prompt runs whole or waits, and
an oversized one runs alone. A decode that cannot grow its blocks preempts the newest running sequence not
yet scheduled (recompute: its blocks are freed, it goes back to the front of the queue with its tokens).
The step's time comes from the role's LatencyModel; its outcome lands when the step ends.

Roles: "prefill" (a sequence leaves after its prompt: first token sampled, KV held for the handoff),
"decode" (imports handed-off KV; recomputes preempted sequences locally) and "colocated" (both).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from pdserve.latency_model import LatencyModel
from pdserve.placement.policy import ReplicaSnapshot
from pdserve.sim.config import EngineSpec, SimRequest


@dataclass(eq=False)
class SimSeq:
    request: SimRequest
    num_tokens: int  # prompt + generated tokens
    num_generated: int = 0
    num_computed: int = 0  # tokens whose KV is in this replica's blocks
    num_blocks: int = 0
    is_decoding: bool = False
    max_prefill_chunk: int | None = None
    num_preemptions: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.num_generated >= self.request.output_tokens


@dataclass
class Batch:
    decodes: list[SimSeq] = field(default_factory=list)
    prefills: list[tuple[SimSeq, int, int]] = field(default_factory=list)  # (seq, chunk tokens, cached before)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n, _ in self.prefills)


@dataclass
class StepOutcome:
    prefilled: list[SimSeq] = field(default_factory=list)  # role prefill: first token sampled, KV held
    finished: list[SimSeq] = field(default_factory=list)


class Engine:
    def __init__(self, replica_id: str, role: str, spec: EngineSpec, model: LatencyModel) -> None:
        self.replica_id, self.role, self.spec, self.model = replica_id, role, spec, model
        self.waiting: deque[SimSeq] = deque()
        self.importing: deque[SimSeq] = deque()  # handed-off KV waiting for blocks (decode)
        self.running: list[SimSeq] = []
        self.num_free_blocks = spec.num_blocks
        self.cached: OrderedDict[int, None] = OrderedDict()  # prefix-cache block hashes, LRU first
        self.step_times: deque[float] = deque(maxlen=spec.recent_steps)
        self.step_tokens: deque[float] = deque(maxlen=spec.recent_steps)
        self.busy_until: float | None = None  # end of the step in flight
        self.num_preemptions = 0
        self.num_steps = 0

    # --- admission ---------------------------------------------------------------------------------

    def add(self, request: SimRequest, max_prefill_chunk: int | None = None) -> SimSeq:
        seq = SimSeq(request, request.prompt_tokens, max_prefill_chunk=max_prefill_chunk)
        self.waiting.append(seq)
        return seq

    def add_imported(self, seq: SimSeq) -> None:
        """A handed-off sequence: prompt KV computed elsewhere, first token generated."""
        seq.num_computed, seq.num_blocks, seq.is_decoding = seq.num_tokens - 1, 0, True
        self.importing.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.importing or self.running)

    @property
    def is_idle(self) -> bool:
        return not self.has_work and self.busy_until is None

    def queued_prefill_tokens(self) -> int:
        return sum(s.num_uncomputed for s in self.waiting) + sum(
            s.num_uncomputed for s in self.running if not s.is_decoding)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.spec.block_size)

    def _grow(self, seq: SimSeq, num_tokens: int) -> bool:
        need = self.blocks_for(num_tokens) - seq.num_blocks
        if need > self.num_free_blocks:
            return False
        if need > 0:
            self.num_free_blocks -= need
            seq.num_blocks += need
        return True

    def free(self, seq: SimSeq) -> None:
        self.num_free_blocks += seq.num_blocks
        seq.num_blocks = 0

    # --- one step ----------------------------------------------------------------------------------

    def schedule(self) -> Batch:
        spec, batch = self.spec, Batch()
        budget, scheduled = spec.max_num_batched_tokens, set()
        while self.importing and len(self.running) < spec.max_num_seqs:
            seq = self.importing[0]
            if not self._grow(seq, seq.num_computed):
                break
            self.running.append(self.importing.popleft())
        for seq in list(self.running):
            if budget == 0 or len(batch.decodes) >= spec.max_num_seqs:
                break
            if seq.is_decoding and seq in self.running and self._grow_or_preempt(seq, seq.num_tokens, scheduled):
                batch.decodes.append(seq)
                scheduled.add(id(seq))
                budget -= 1
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.is_decoding or id(seq) in scheduled or seq not in self.running:
                continue
            n = self._chunk(seq, budget, batch)
            if n and self._grow_or_preempt(seq, seq.num_computed + n, scheduled):
                batch.prefills.append((seq, n, seq.num_computed))
                scheduled.add(id(seq))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < spec.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_blocks == 0:
                seq.num_computed = self._prefix_hit(seq)
            n = self._chunk(seq, budget, batch)
            if not n or self.blocks_for(seq.num_tokens) - seq.num_blocks > self.num_free_blocks:
                self._reset(seq)
                break
            self._grow(seq, seq.num_computed + n)
            self.running.append(self.waiting.popleft())
            batch.prefills.append((seq, n, seq.num_computed))
            scheduled.add(id(seq))
            budget -= n
        return batch

    def _chunk(self, seq: SimSeq, budget: int, batch: Batch) -> int:
        remaining = seq.num_uncomputed
        if seq.max_prefill_chunk is not None:
            budget = min(budget, seq.max_prefill_chunk)
        if self.spec.enable_chunked_prefill or seq.max_prefill_chunk is not None:
            return min(remaining, budget)
        is_empty = not batch.decodes and not batch.prefills
        if remaining <= budget or (remaining > self.spec.max_num_batched_tokens and is_empty):
            return remaining  # an oversized prompt runs alone rather than never
        return 0

    def _grow_or_preempt(self, seq: SimSeq, num_tokens: int, scheduled: set[int]) -> bool:
        while not self._grow(seq, num_tokens):
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled), None)
            if victim is None:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: SimSeq) -> None:
        self.running.remove(seq)
        self._reset(seq)
        seq.is_decoding = False
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _reset(self, seq: SimSeq) -> None:
        self.free(seq)
        seq.num_computed = 0

    def _prefix_hit(self, seq: SimSeq) -> int:
        if not self.spec.enable_prefix_caching or seq.num_generated:
            return 0
        hits = 0
        for h in seq.request.block_hashes:
            if h not in self.cached:
                break
            self.cached.move_to_end(h)
            hits += 1
        return min(hits * self.spec.block_size, seq.num_tokens - 1)

    def _remember(self, seq: SimSeq) -> None:
        if not self.spec.enable_prefix_caching:
            return
        for h in seq.request.block_hashes:
            self.cached[h] = None
            self.cached.move_to_end(h)
        while len(self.cached) > self.spec.num_blocks:
            self.cached.popitem(last=False)

    def step_time_s(self, batch: Batch) -> float:
        """The step overhead once; each prefill chunk adds its time beyond that overhead."""
        model = self.model
        context = sum(s.num_tokens for s in batch.decodes)
        seconds = model.decode_step_s(len(batch.decodes), context) if batch.decodes else model.prefill.a
        for _, n, cached in batch.prefills:
            seconds += max(model.prefill_time_s(n, cached) - model.prefill.a, 0.0)
        return seconds

    def complete(self, batch: Batch, now: float, seconds: float) -> StepOutcome:
        """Applies a step that ended at `now` and took `seconds`."""
        out = StepOutcome()
        self.num_steps += 1
        self.step_times.append(seconds)
        self.step_tokens.append(float(batch.num_tokens))
        for seq, n, _ in batch.prefills:
            if seq not in self.running:
                continue  # preempted after this step was scheduled: its work is lost
            seq.num_computed += n
            if seq.num_computed < seq.num_tokens:
                continue
            self._remember(seq)
            if self.role == "prefill":
                self.running.remove(seq)  # its blocks stay held until the handoff completes
                seq.num_generated, seq.num_tokens = 1, seq.num_tokens + 1
                out.prefilled.append(seq)
            else:
                seq.is_decoding = True
                self._emit(seq, now, out)
        for seq in batch.decodes:
            if seq in self.running:
                seq.num_computed = seq.num_tokens
                self._emit(seq, now, out)
        return out

    def _emit(self, seq: SimSeq, now: float, out: StepOutcome) -> None:
        seq.num_generated += 1
        seq.num_tokens += 1
        if seq.first_token_s is None:
            seq.first_token_s = now
        if seq.is_finished:
            seq.finish_s = now
            self.running.remove(seq)
            self.free(seq)
            out.finished.append(seq)

    # --- stats -------------------------------------------------------------------------------------

    def snapshot(self, role: str, age_s: float, with_prefixes: bool) -> ReplicaSnapshot:
        spec = self.spec
        return ReplicaSnapshot(
            self.replica_id, role, age_s, num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.importing),
            queued_prefill_tokens=self.queued_prefill_tokens(), num_free_blocks=self.num_free_blocks,
            num_total_blocks=spec.num_blocks, block_size=spec.block_size,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            recent_step_time_s=sum(self.step_times) / len(self.step_times) if self.step_times else None,
            recent_step_tokens=sum(self.step_tokens) / len(self.step_tokens) if self.step_tokens else None,
            num_context_tokens=sum(s.num_computed for s in self.running),
            prefix_hashes=frozenset(self.cached) if with_prefixes else None,
        )
