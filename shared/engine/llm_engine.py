"""Synchronous engine core: add requests, step, abort. One step = schedule -> run -> sample -> postprocess."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pdserve.config import EngineConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.emit import check_request, check_stop, token_delta
from pdserve.engine.engine_leases import EngineLeases
from pdserve.engine.kv_parts import part_tokens, take_parts
from pdserve.engine.lease import LeaseTable
from pdserve.engine.model_runner import ModelRunner, PromptRows, kv_block_bytes
from pdserve.engine.outputs import EngineStats, GenerationRequest, TokenDelta
from pdserve.engine.sampler import Sampler, prompt_logprobs
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec import Drafter
from pdserve.engine.spec.verify import Verified, verify
from pdserve.engine.step_clock import StepClock
from pdserve.engine.tp_group import TensorParallelModel
from pdserve.engine.tp_kv import ShardedKV
from pdserve.models.config import load_model_config
from pdserve.models.loader import load_model
from pdserve.models.resolve import resolve_model_path
from pdserve.models.served import served_line
from pdserve.models.tensor_parallel import check_tensor_parallel
from pdserve.models.tokenizer import Tokenizer
from pdserve.structured import GrammarCompiler, Vocabulary

logger = logging.getLogger(__name__)


@dataclass
class _RequestState:
    seq: Sequence
    detokenizer: IncrementalDetokenizer


class LLMEngine(EngineLeases):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        model_dir = resolve_model_path(config.model)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        max_len = config.scheduler.max_model_len
        tp = config.tensor_parallel_size
        if tp > 1:
            check_tensor_parallel(load_model_config(model_dir), tp)  # refused before any weight is read
        model, self.model_config = load_model(
            model_dir, config.torch_dtype, config.device, max_positions=max_len,
            pack_weights=config.pack_weights and tp == 1, quantization=config.weight_quantization,
        )
        self.served_weights = served_line(model, self.model_config, model_dir, config.weight_quantization,
                                          config.resolved_dtype, config.dtype, config.device)
        if config.weight_quantization != config.quantization:
            self.served_weights = f"quantization auto on {tp} tensor-parallel ranks: model dtype; {self.served_weights}"
        kv = config.cache.kv_cache_dtype
        self.served_weights += f"; KV cache {kv if kv != 'auto' else f'auto ({config.resolved_dtype})'}"
        logger.info("%s", self.served_weights)
        self.max_model_len = max_len or self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            # No sliding-window attention here: cap the context where full attention is still exact.
            self.max_model_len = min(self.max_model_len, self.model_config.sliding_window)
        block_size = config.cache.block_size
        num_blocks = config.cache.num_blocks or max(
            1, config.cache.memory_budget_bytes
            // kv_block_bytes(self.model_config, block_size, config.torch_dtype, config.cache.kv_cache_dtype)
        )
        runner_config = self.model_config
        self.tensor_parallel: TensorParallelModel | None = None
        if tp > 1:
            # the driver's pool holds its own heads; num_blocks sized on the full model's block bytes
            model = self.tensor_parallel = TensorParallelModel(model, config, str(model_dir), num_blocks, max_len)
            runner_config = model.local_config
        self.runner = ModelRunner(
            model, runner_config, block_size, num_blocks, config.torch_dtype, config.device,
            attention_override=config.attention_backend, kv_cache_dtype=config.cache.kv_cache_dtype,
        )
        # a TP replica hands KV on in the whole model's layout (pdserve.engine.tp_kv)
        self.sharded_kv = None if self.tensor_parallel is None else ShardedKV(
            self.tensor_parallel, self.runner.kv_pool, self.model_config, block_size, config.torch_dtype,
            config.cache.kv_cache_dtype)
        self.block_manager = BlockManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        drafter = None if config.speculative is None else Drafter.from_config(config.speculative, self.max_model_len)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, drafter)
        self.sampler = Sampler(config.seed)
        self.leases = LeaseTable(config.lease_ttl_s)
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self.requests: dict[str, _RequestState] = {}
        # recent steps and the gaps between them (loop hand-offs, streaming, everything under the GIL)
        self.clock = StepClock()
        self.num_preemptions = 0
        self.num_expired_leases = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_verifications = 0

    # --- requests -------------------------------------------------------------------------------

    def add_request(self, request: GenerationRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        vocab = self.model_config.vocab_size
        prompt = check_request(request, vocab, self.max_model_len, self.block_manager.block_size,
                               self.block_manager.num_blocks)
        seq = Sequence(
            request.request_id, prompt, request.params, self.block_manager.block_size,
            eos_token_ids=self.tokenizer.eos_token_ids, prefill_only=request.prefill_only,
            priority=request.priority, arrival_time=request.arrival_time,
            max_prefill_chunk=request.max_prefill_chunk,
        )
        if request.kv_part_tokens is not None:
            seq.kv_part_tokens = part_tokens(request.kv_part_tokens, seq.block_size)
            seq.max_prefill_chunk = min(seq.max_prefill_chunk or seq.kv_part_tokens, seq.kv_part_tokens)
        resumed = request.num_resumed_tokens
        if request.params.json_schema is not None:
            # the grammar resumes from the output so far: a resumed tail, then an adopted first token
            replay = (*prompt[len(prompt) - resumed :], *(() if request.first_token_id is None else
                                                         (request.first_token_id,)))
            seq.grammar = self.grammars.matcher(request.params.json_schema, replay)
        # token j of a seeded stream takes the request's j-th draw, wherever it is sampled: skip the draws
        # of tokens sampled elsewhere (rng_offset) and of an adopted first token (prefill drew it)
        drawn = request.rng_offset + (request.first_token_id is not None)
        if drawn and seq.generator is not None:
            Sampler.skip(seq.generator, drawn, vocab)
        seq.num_resumed_tokens = resumed
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt[: len(prompt) - resumed], stop=request.params.stop,
            include_stop_str_in_output=request.params.include_stop_str_in_output,
            skip_special_tokens=request.params.skip_special_tokens,
        )
        if resumed:
            detok.add_tokens(prompt[len(prompt) - resumed :])  # the text was sent already; what it holds stays
        if request.adopt_lease_id is not None:
            lease = self.leases.take(request.adopt_lease_id)
            if lease.num_tokens != len(prompt) or len(lease.block_ids) < seq.blocks_needed(len(prompt)):
                self.block_manager.release_blocks(list(lease.block_ids))
                raise ValueError("lease does not cover the prompt")
            if self.sharded_kv is not None:
                self.sharded_kv.scatter(lease.block_ids)  # pulled into the canonical pool: out to the ranks
            seq.block_table = list(lease.block_ids)
            seq.num_computed_tokens = len(prompt)
            seq.prompt_logprobs = None  # computed by the engine that prefilled
            self.block_manager.register_full_blocks(seq)
            seq.token_ids.append(request.first_token_id)
            self.requests[seq.request_id] = _RequestState(seq, detok)
            detok.add_tokens([request.first_token_id])
            self.scheduler.add_running(seq)
            return
        self.requests[seq.request_id] = _RequestState(seq, detok)
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        if not state.seq.is_finished:
            self.scheduler.finish(state.seq, "abort")
        if not self.requests:
            self.clock.idle()  # the engine may idle now: no gap until a step ends with work left
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def is_broken(self) -> bool:
        """A tensor-parallel rank died, hung or failed: this engine cannot step again."""
        return self.tensor_parallel is not None and self.tensor_parallel.failed is not None

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker ranks, if any (idempotent; also done at interpreter exit)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
        self.clock.close()

    @property
    def grammars(self) -> GrammarCompiler:
        """response_format's compiler and grammar cache; its token index (~0.3 s for a 49k vocabulary) is
        built on the first constrained request, so engines that never see one never pay for it."""
        if self._grammars is None:
            vocab = Vocabulary(self.tokenizer.backend.to_str(), self.tokenizer.vocab_size,
                               self.model_config.vocab_size, tuple(sorted(self.tokenizer.eos_token_ids)))
            self._grammars = GrammarCompiler(self.config.structured, vocab)
        return self._grammars

    # --- stepping --------------------------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        self.expire_leases()
        batch = self.scheduler.schedule()
        self.num_preemptions += len(batch.preempted)
        if batch.is_empty:
            return []
        self.clock.begin()
        # a prefix-cache hit's full blocks can leave before the rest of the prompt is computed
        cached_parts = take_parts([seq for seq, _ in batch.prefills], self.block_manager, self.leases)
        seqs, logits, prompt_rows, verify_rows = self.runner.run(batch)
        for rows in prompt_rows:
            _record_prompt_logprobs(rows)
        sampled = self.sampler(logits, seqs) if seqs else None
        verified = verify(self.sampler, verify_rows) if verify_rows else []
        self._advance(batch, verified)
        outputs = cached_parts + take_parts([seq for seq, _ in batch.prefills], self.block_manager, self.leases)
        if seqs:
            outputs.extend(self._postprocess(seqs, sampled))
        for result in verified:
            outputs.extend(self._postprocess_verified(result))
        if self.sharded_kv is not None:
            self._gather_handed_off(outputs)
        self.clock.end(batch.num_tokens, self.has_unfinished(), prefill=bool(batch.prefills))
        return outputs

    def _advance(self, batch: ScheduledBatch, verified: list[Verified]) -> None:
        for seq in batch.decodes:
            if seq not in batch.drafts:
                seq.num_computed_tokens += 1
                self.block_manager.register_full_blocks(seq)
        # accepted draft tokens keep their K/V; the rejected ones' slots are dropped with their blocks.
        # Blocks are hashed once the tokens are appended (_postprocess_verified).
        for result in verified:
            seq = result.seq
            seq.num_computed_tokens += 1 + result.num_accepted
            seq.num_draft_tokens += result.num_draft_tokens
            seq.num_accepted_tokens += result.num_accepted
            seq.num_verifications += 1
            self.scheduler.drafter.observe(seq, result.num_draft_tokens, result.num_accepted)
            self.num_draft_tokens += result.num_draft_tokens
            self.num_accepted_tokens += result.num_accepted
            self.num_verifications += 1
        if batch.drafts:
            self.block_manager.rollback([(r.seq, r.seq.num_computed_tokens) for r in verified])
        for seq, num_new in batch.prefills:
            seq.num_prefill_chunks += 1
            seq.num_computed_tokens += num_new
            self.block_manager.register_full_blocks(seq)

    def _postprocess(self, seqs: list[Sequence], sampled) -> list[TokenDelta]:
        return [
            self._emit(seq, sampled.token_ids[i], sampled.logprobs[i], sampled.top_logprobs[i])
            for i, seq in enumerate(seqs)
        ]

    def _postprocess_verified(self, result: Verified) -> list[TokenDelta]:
        """One delta per emitted token, as without drafts; a stop inside the draft drops the rest."""
        outputs = []
        for token, logprob, top in zip(result.token_ids, result.logprobs, result.top_logprobs):
            outputs.append(self._emit(result.seq, token, logprob, top))
            if outputs[-1].finished:
                return outputs
        self.block_manager.register_full_blocks(result.seq)
        return outputs

    def _emit(self, seq: Sequence, token: int, logprob: float | None, top: list | None) -> TokenDelta:
        seq.num_deltas += 1
        seq.token_ids.append(token)
        if seq.grammar is not None and not seq.grammar.consume((token,)):
            # unreachable while the sampler masks by the same grammar; the output would not follow it
            logger.error("request %s: token %d breaks its response format: %s", seq.request_id, token,
                         seq.grammar.error)
        state = self.requests[seq.request_id]
        reason, stop_reason, text = check_stop(seq, state.detokenizer, token, self.max_model_len)
        handoff = None
        if seq.prefill_only and reason is None:
            handoff = self._hand_off(seq)
        elif reason is not None:
            self.scheduler.finish(seq, reason)
        if reason is not None or handoff is not None:
            # Held text (a partial character, a stop-string prefix) stays with the engine that adopts the
            # handoff: its detokenizer replays the first token and holds the same text.
            if handoff is None and (stop_reason is None or isinstance(stop_reason, int)):
                text += state.detokenizer.flush()
            del self.requests[seq.request_id]
        return token_delta(seq, token, text, reason, stop_reason, handoff, logprob, top)

    # --- stats -----------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=self.scheduler.num_waiting,
            num_running=self.scheduler.num_running,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens(),
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_blocks,
            block_size=self.block_manager.block_size,
            num_leased_blocks=self.leases.num_blocks,
            recent_step_times_s=tuple(self.clock.times),
            recent_step_tokens=tuple(self.clock.tokens),
            recent_step_gaps_s=tuple(self.clock.gaps),
            step_totals=self.clock.totals,
            prefix_hit_tokens=self.block_manager.num_prefix_hit_tokens,
            prefix_queried_tokens=self.block_manager.num_prefix_queried_tokens,
            num_preemptions=self.num_preemptions,
            num_expired_leases=self.num_expired_leases,
            max_num_batched_tokens=self.scheduler.config.max_num_batched_tokens,
            num_spec_draft_tokens=self.num_draft_tokens,
            num_spec_accepted_tokens=self.num_accepted_tokens,
            num_spec_verifications=self.num_verifications,
        )


def _record_prompt_logprobs(rows: PromptRows) -> None:
    seq = rows.seq
    targets = seq.token_ids[rows.start + 1 : rows.start + 1 + rows.logits.shape[0]]
    assert len(seq.prompt_logprobs) == rows.start + 1, "prompt rows must continue the recorded positions"
    seq.prompt_logprobs.extend(prompt_logprobs(rows.logits, targets, seq.params.prompt_logprobs))

