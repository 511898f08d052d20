"""A request's way in and its tokens' way out of the engine: the checks a request must pass before it
becomes a sequence; for each sampled token, whether it stops the sequence, and the delta handed on."""

from __future__ import annotations

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.outputs import GenerationRequest, KVHandoff, TokenDelta
from pdserve.engine.sequence import Sequence


def check_request(request: GenerationRequest, vocab: int, max_model_len: int, block_size: int,
                  num_blocks: int) -> list[int]:
    """The request's prompt ids; ValueError when it cannot run here."""
    prompt = list(request.prompt_token_ids)
    if any(t < 0 or t >= vocab for t in prompt):
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if request.first_token_id is not None and not 0 <= request.first_token_id < vocab:
        raise ValueError(f"first_token_id must be in [0, {vocab})")
    total = len(prompt) + request.params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({request.params.max_tokens}) exceeds "
            f"the model's context length {max_model_len}"
        )
    needed = -(-total // block_size)
    if needed > num_blocks:
        # It could never run to completion: it would preempt itself forever.
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_tokens ({request.params.max_tokens}) needs {needed} KV "
            f"blocks, more than this engine's pool of {num_blocks}"
        )
    return prompt


def check_stop(seq: Sequence, detok: IncrementalDetokenizer, token: int,
               max_model_len: int) -> tuple[str | None, str | int | None, str]:
    """(finish reason, stop reason, text the token adds) for `token`, already appended to `seq`."""
    params = seq.params
    # the sampler masked eos and stop ids while fewer than min_tokens had been generated
    may_stop = seq.num_output_tokens > params.min_tokens
    if may_stop and token in params.stop_token_ids:
        text = detok.add_tokens([token]) if params.include_stop_str_in_output else ""
        return "stop", token, text
    if may_stop and not params.ignore_eos and token in seq.eos_token_ids:
        return "stop", None, ""
    text = detok.add_tokens([token])
    if detok.stopped_by is not None:
        return "stop", detok.stopped_by, text
    if seq.grammar is not None and seq.grammar.is_finished:  # the value is complete: nothing may follow
        return "stop", None, text
    if seq.num_output_tokens >= params.max_tokens or len(seq) >= max_model_len:
        return "length", None, text
    return None, None, text


def token_delta(seq: Sequence, token: int, text: str, reason: str | None, stop_reason: str | int | None,
                handoff: KVHandoff | None, logprob: float | None, top: list | None) -> TokenDelta:
    """The delta for `seq`'s latest token; the first delta of a sequence carries its queue time and prompt
    logprobs."""
    first = seq.num_deltas == 1
    prompt = seq.prompt_logprobs if first else None
    return TokenDelta(
        request_id=seq.request_id, token_ids=(token,), text=text,
        finished=reason is not None or handoff is not None, finish_reason=reason, stop_reason=stop_reason,
        logprobs=None if logprob is None else (logprob,),
        top_logprobs=None if top is None else (tuple(top),),
        num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_output_tokens,
        num_cached_tokens=seq.num_cached_tokens, kv_handoff=handoff,
        queue_time_s=_queue_time(seq) if first else None,
        num_prefill_chunks=seq.num_prefill_chunks,
        prompt_logprobs=None if prompt is None else tuple(lp for lp, _ in prompt),
        prompt_top_logprobs=None if prompt is None else tuple(top for _, top in prompt),
        num_draft_tokens=seq.num_draft_tokens, num_accepted_tokens=seq.num_accepted_tokens,
        num_verifications=seq.num_verifications,
    )


def _queue_time(seq: Sequence) -> float | None:
    if seq.first_scheduled_time is None:
        return None
    return max(0.0, seq.first_scheduled_time - seq.arrival_time)
