"""Coalesced token streams: the deltas produced since the consumer last took one, merged into one
(`AsyncLLMEngine.generate_batches` groups them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pdserve.engine.outputs import TokenDelta


def _concat(a: tuple | None, b: tuple | None) -> tuple | None:
    if a is None and b is None:
        return None
    return (a or ()) + (b or ())


def merge_deltas(deltas: Sequence[TokenDelta]) -> TokenDelta:
    """One delta equal to `deltas` in order: tokens, text and logprobs joined; the end state of the last;
    the once-only fields (queue time, cached tokens, handoff, prompt logprobs) of the first that has them."""
    merged = deltas[0]
    for d in deltas[1:]:
        merged = dataclasses.replace(
            d,
            token_ids=merged.token_ids + d.token_ids, text=merged.text + d.text,
            logprobs=_concat(merged.logprobs, d.logprobs), top_logprobs=_concat(merged.top_logprobs, d.top_logprobs),
            num_cached_tokens=max(merged.num_cached_tokens, d.num_cached_tokens),
            kv_handoff=merged.kv_handoff or d.kv_handoff,
            queue_time_s=merged.queue_time_s if merged.queue_time_s is not None else d.queue_time_s,
            num_prefill_chunks=max(merged.num_prefill_chunks, d.num_prefill_chunks),
            prompt_logprobs=merged.prompt_logprobs if merged.prompt_logprobs is not None else d.prompt_logprobs,
            prompt_top_logprobs=(merged.prompt_top_logprobs if merged.prompt_top_logprobs is not None
                                 else d.prompt_top_logprobs),
        )
    return merged
