"""OpenAI response bodies and SSE chunks for completions and chat completions.

A `Choice` accumulates one choice's events (TokenDelta dicts); the format functions turn choices and
deltas into the exact objects OpenAI returns.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.models.tokenizer import Tokenizer

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def cached_tokens(per_choice: list[int | None], n: int) -> int:
    """Prompt tokens served from the prefix cache, counted once per prompt as prompt_tokens are: each
    prompt's fewest over its n choices (a choice not started yet counts 0)."""
    return sum(min(c or 0 for c in per_choice[i : i + n]) for i in range(0, len(per_choice), n))


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int | None = None  # from the choice's first event (prefill's, when disaggregated)

    def add(self, event: dict[str, Any]) -> None:
        if self.num_cached_tokens is None:
            self.num_cached_tokens = event.get("num_cached_tokens") or 0
        self.text += event.get("text") or ""
        self.token_ids.extend(event.get("token_ids") or ())
        self.logprobs.extend(event.get("logprobs") or ())
        self.top_logprobs.extend([list(map(tuple, t)) for t in event.get("top_logprobs") or ()])
        if event.get("finished"):
            self.finish_reason = event.get("finish_reason")


@dataclass(frozen=True)
class ResponseMeta:
    id: str
    model: str
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def _token_str(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]], offset: int
) -> dict[str, Any] | None:
    if len(logprobs) != len(token_ids):
        return None
    tokens = [_token_str(tokenizer, t) for t in token_ids]
    text_offset, pos = [], offset
    for tok in tokens:
        text_offset.append(pos)
        pos += len(tok)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": [
            {_token_str(tokenizer, i): lp for i, lp in (top[k] if k < len(top) else ())} for k in range(len(tokens))
        ],
        "text_offset": text_offset,
    }


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float], top: list[list[tuple[int, float]]]
) -> dict[str, Any] | None:
    if len(logprobs) != len(token_ids):
        return None

    def entry(token_id: int, lp: float) -> dict[str, Any]:
        tok = _token_str(tokenizer, token_id)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    content = []
    for k, (token_id, lp) in enumerate(zip(token_ids, logprobs)):
        item = entry(token_id, lp)
        item["top_logprobs"] = [entry(i, p) for i, p in (top[k] if k < len(top) else ())]
        content.append(item)
    return {"content": content}


def response_body(
    meta: ResponseMeta, choices: list[Choice], num_prompt_tokens: int, tokenizer: Tokenizer, want_logprobs: bool,
    n: int = 1,
) -> dict[str, Any]:
    """`choices` in index order, `n` per prompt; `num_prompt_tokens` sums over the prompts."""
    out = []
    for c in choices:
        lp = None
        if want_logprobs:
            lp = (chat_logprobs(tokenizer, c.token_ids, c.logprobs, c.top_logprobs) if meta.chat
                  else completion_logprobs(tokenizer, c.token_ids, c.logprobs, c.top_logprobs, 0))
        if meta.chat:
            out.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": lp, "finish_reason": c.finish_reason})
        else:
            out.append({"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
    return {
        "id": meta.id, "object": meta.object, "created": meta.created, "model": meta.model, "choices": out,
        "usage": usage(num_prompt_tokens, sum(len(c.token_ids) for c in choices),
                       cached_tokens([c.num_cached_tokens for c in choices], n)),
    }


def chunk(
    meta: ResponseMeta, choices: list[dict[str, Any]], include_usage: bool, usage_obj: dict[str, Any] | None = None
) -> bytes:
    body: dict[str, Any] = {
        "id": meta.id, "object": meta.chunk_object, "created": meta.created, "model": meta.model, "choices": choices,
    }
    if include_usage:
        body["usage"] = usage_obj
    return sse(body)


def choice_chunk(
    meta: ResponseMeta, index: int, event: dict[str, Any], tokenizer: Tokenizer, want_logprobs: bool,
    text_offset: int, first: bool,
) -> dict[str, Any]:
    """One choice's part of a stream chunk for one event (TokenDelta dict)."""
    token_ids = list(event.get("token_ids") or ())
    logprobs = list(event.get("logprobs") or ())
    top = [list(map(tuple, t)) for t in event.get("top_logprobs") or ()]
    text = event.get("text") or ""
    finish = event.get("finish_reason") if event.get("finished") else None
    if meta.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        lp = chat_logprobs(tokenizer, token_ids, logprobs, top) if want_logprobs and token_ids else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
    lp = completion_logprobs(tokenizer, token_ids, logprobs, top, text_offset) if want_logprobs and token_ids else None
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}


def model_list(name: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "pdserve", "max_model_len": max_model_len}
    ]}
