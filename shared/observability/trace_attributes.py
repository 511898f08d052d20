"""Span names and attribute names: the OpenTelemetry GenAI semantic conventions plus pdserve's own.

Plain constants and dict builders, no OpenTelemetry import, so any module may use them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

# ---- GenAI semantic conventions (gen_ai.*)
OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_STREAM = "gen_ai.request.stream"
REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
# Content: only set when PDSERVE_TRACE_CONTENT opts in (see content_attributes).
INPUT_MESSAGES = "gen_ai.input.messages"
OUTPUT_MESSAGES = "gen_ai.output.messages"

OPERATION_CHAT = "chat"
OPERATION_TEXT_COMPLETION = "text_completion"
PROVIDER = "pdserve"

# ---- pdserve.*
ROLE = "pdserve.role"
REQUEST_ID = "pdserve.request.id"
PREFILL_REPLICA = "pdserve.prefill.replica"
DECODE_REPLICA = "pdserve.decode.replica"
PREFIX_CACHE_HIT_TOKENS = "pdserve.prefix_cache.hit_tokens"
KV_TRANSPORT = "pdserve.kv.transport"
KV_BYTES = "pdserve.kv.bytes"
KV_PARTS = "pdserve.kv.parts"  # parts pulled while prefill ran, before the tail
KV_EXPOSED_SECONDS = "pdserve.kv.exposed_seconds"  # transfer time after prefill ended
KV_TRANSFER_SECONDS = "pdserve.kv.transfer_seconds"  # the whole transfer, parts and tail
KV_BLOCKS = "pdserve.kv.blocks"
DISAGGREGATE = "pdserve.disaggregate"
DECISION_REASON = "pdserve.decision.reason"
FALLBACK_REASON = "pdserve.fallback.reason"
REJECTION_REASON = "pdserve.rejection.reason"
QUEUE_SECONDS = "pdserve.queue.seconds"
PREFILL_CHUNKS = "pdserve.prefill.chunks"
PROMPT_TOKENS = "pdserve.prompt.tokens"
TTFT_SECONDS = "pdserve.ttft.seconds"
# speculative decoding, per request on the decode span
SPEC_DRAFT_TOKENS = "pdserve.spec.draft_tokens"
SPEC_ACCEPTED_TOKENS = "pdserve.spec.accepted_tokens"
SPEC_VERIFICATIONS = "pdserve.spec.verifications"
SPEC_ACCEPTANCE_RATE = "pdserve.spec.acceptance_rate"
SPEC_MEAN_ACCEPTED_LENGTH = "pdserve.spec.mean_accepted_length"

# ---- span names for the stages below the request span (which is `chat {model}` etc.)
SPAN_ROUTE = "pdserve.route"
SPAN_QUEUE = "pdserve.queue"
SPAN_PREFILL = "pdserve.prefill"
SPAN_KV_TRANSFER = "pdserve.kv.transfer"
SPAN_DECODE = "pdserve.decode"

# ---- span event names
EVENT_FIRST_TOKEN = "pdserve.first_token"
EVENT_FALLBACK = "pdserve.fallback"
EVENT_MIGRATION = "pdserve.migration"


def speculation_attributes(num_draft_tokens: int, num_accepted_tokens: int, num_verifications: int) -> dict:
    """A request's speculative decoding, for its decode span."""
    return {
        SPEC_DRAFT_TOKENS: num_draft_tokens, SPEC_ACCEPTED_TOKENS: num_accepted_tokens,
        SPEC_VERIFICATIONS: num_verifications,
        SPEC_ACCEPTANCE_RATE: num_accepted_tokens / num_draft_tokens if num_draft_tokens else 0.0,
        SPEC_MEAN_ACCEPTED_LENGTH: num_accepted_tokens / num_verifications if num_verifications else 0.0,
    }


def operation_name(chat: bool) -> str:
    return OPERATION_CHAT if chat else OPERATION_TEXT_COMPLETION


def request_span_name(operation: str, model: str) -> str:
    """`{gen_ai.operation.name} {gen_ai.request.model}`, e.g. `chat tiny`."""
    return f"{operation} {model}"


def _present(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if v is not None}


def request_attributes(
    operation: str,
    model: str,
    *,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stream: bool | None = None,
    choice_count: int | None = None,
    request_id: str | None = None,
) -> dict[str, Any]:
    """Attributes known when the request arrives; None values are left out."""
    return _present(
        {
            OPERATION_NAME: operation,
            PROVIDER_NAME: PROVIDER,
            REQUEST_MODEL: model,
            REQUEST_MAX_TOKENS: max_tokens,
            REQUEST_TEMPERATURE: temperature,
            REQUEST_TOP_P: top_p,
            REQUEST_TOP_K: top_k,
            REQUEST_SEED: seed,
            REQUEST_STREAM: stream,
            REQUEST_CHOICE_COUNT: choice_count if choice_count != 1 else None,
            REQUEST_ID: request_id,
        }
    )


def response_attributes(
    *,
    response_id: str | None = None,
    model: str | None = None,
    input_tokens: int | None = None,
    output_tokens: int | None = None,
    finish_reasons: Iterable[str] | None = None,
) -> dict[str, Any]:
    """Attributes known when the response is complete; None values are left out."""
    reasons = [str(r) for r in finish_reasons] if finish_reasons is not None else None
    return _present(
        {
            RESPONSE_ID: response_id,
            RESPONSE_MODEL: model,
            USAGE_INPUT_TOKENS: input_tokens,
            USAGE_OUTPUT_TOKENS: output_tokens,
            RESPONSE_FINISH_REASONS: reasons,
        }
    )


def content_attributes(
    record_content: bool,
    *,
    prompt: str | Sequence[dict[str, Any]] | None = None,
    completions: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Prompt and completion text as JSON message lists, or {} unless the operator opted in.

    `prompt` is a completion prompt (str) or the chat messages as received; `completions` one text per choice.
    """
    if not record_content:
        return {}
    attrs: dict[str, Any] = {}
    if prompt is not None:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        attrs[INPUT_MESSAGES] = json.dumps(messages, ensure_ascii=False, default=str)
    if completions is not None:
        choices = [{"role": "assistant", "content": text} for text in completions]
        attrs[OUTPUT_MESSAGES] = json.dumps(choices, ensure_ascii=False)
    return attrs
