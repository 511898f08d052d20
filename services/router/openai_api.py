"""OpenAI response bodies and SSE chunks for completions and chat completions.

A `Choice` accumulates one choice's token batches (`pdserve.api.contract.TokenBatch`); the format functions turn choices and
deltas into the exact objects OpenAI returns.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.contract import TokenBatch
from pdserve.api.tool_parser import ToolEvents, parse_message
from pdserve.api.tools import ToolPlan
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
    text: str = ""  # at construction: the echoed prompt, if any
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int | None = None  # from the choice's first event (prefill's, when disaggregated)
    prompt_token_ids: tuple[int, ...] = ()  # echo with logprobs: the prompt, whose logprobs lead the choice's
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    num_echo_chars: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_echo_chars = len(self.text)

    def add(self, event: TokenBatch) -> None:
        if self.num_cached_tokens is None:
            self.num_cached_tokens = event.num_cached_tokens
        if self.prompt_token_ids and not self.prompt_logprobs and event.prompt_logprobs is not None:
            self.prompt_logprobs = list(event.prompt_logprobs)
            self.prompt_top_logprobs = _tops(event.prompt_top_logprobs)
        self.text += event.text
        self.token_ids.extend(event.token_ids)
        self.logprobs.extend(event.logprobs or ())
        self.top_logprobs.extend(_tops(event.top_logprobs))
        if event.finished:
            self.finish_reason = event.finish_reason


def _tops(values) -> list[list[tuple[int, float]] | None]:
    return [None if t is None else list(map(tuple, t)) for t in values or ()]


def echo_logprobs(
    tokenizer: Tokenizer, prompt_ids: tuple[int, ...], prompt_logprobs, prompt_top_logprobs, echo: str
) -> dict[str, Any] | None:
    """The echoed prompt's part of a completion's logprobs object, from the prompt logprobs a choice's first
    batch carried; None without prompt ids or prompt logprobs. Text offsets index `echo`: a special token it does not spell (a BOS the
    tokenizer added to a string prompt) takes no characters."""
    if not prompt_ids or prompt_logprobs is None:
        return None
    out = completion_logprobs(tokenizer, list(prompt_ids), list(prompt_logprobs), _tops(prompt_top_logprobs), 0)
    if out is not None:
        offsets, pos = [], 0
        for token_id, tok in zip(prompt_ids, out["tokens"]):
            offsets.append(min(pos, len(echo)))
            if echo.startswith(tok, pos) or tokenizer.decode([token_id], skip_special_tokens=True):
                pos += len(tok)
        out["text_offset"] = offsets
    return out


def merge_logprobs(lead: dict[str, Any] | None, rest: dict[str, Any] | None) -> dict[str, Any] | None:
    if lead is None or rest is None:
        return lead or rest
    return {key: lead[key] + rest[key] for key in lead}


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
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float | None],
    top: list[list[tuple[int, float]] | None], offset: int,
) -> dict[str, Any] | None:
    """A `None` logprob or top entry (an echoed prompt's first token: nothing precedes it) stays null."""
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
            None if k < len(top) and top[k] is None else
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
    n: int = 1, tools: ToolPlan | None = None,
) -> dict[str, Any]:
    """`choices` in index order, `n` per prompt; `num_prompt_tokens` sums over the prompts; with `tools`, each
    chat choice's text is parsed for tool calls."""
    out = []
    for c in choices:
        lp = None
        if want_logprobs:
            if meta.chat:
                lp = chat_logprobs(tokenizer, c.token_ids, c.logprobs, c.top_logprobs)
            else:  # generated tokens' offsets start after the echoed prompt's text, if any
                echo = c.text[: c.num_echo_chars]
                lead = echo_logprobs(tokenizer, c.prompt_token_ids, c.prompt_logprobs or None, c.prompt_top_logprobs,
                                     echo)
                own = completion_logprobs(tokenizer, c.token_ids, c.logprobs, c.top_logprobs, len(echo))
                lp = merge_logprobs(lead, own)
        if meta.chat:
            message, finish = {"role": "assistant", "content": c.text}, c.finish_reason
            if tools is not None:
                message, finish = parse_message(tools, c.text, finish)
            out.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish})
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
    meta: ResponseMeta, index: int, event: TokenBatch, tokenizer: Tokenizer, want_logprobs: bool,
    text_offset: int, first: bool, lead: dict[str, Any] | None = None, text: str | None = None,
) -> dict[str, Any]:
    """One choice's part of a stream chunk for one token batch; `lead` (an echoed prompt's logprobs) goes
    before the batch's own, which start at `text_offset`; `text` replaces the batch's (echo + text)."""
    token_ids = list(event.token_ids)
    logprobs = list(event.logprobs or ())
    top = _tops(event.top_logprobs)
    text = event.text if text is None else text
    finish = event.finish_reason if event.finished else None
    if meta.chat:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        lp = chat_logprobs(tokenizer, token_ids, logprobs, top) if want_logprobs and token_ids else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
    lp = completion_logprobs(tokenizer, token_ids, logprobs, top, text_offset) if want_logprobs and token_ids else None
    return {"index": index, "text": text, "logprobs": merge_logprobs(lead, lp), "finish_reason": finish}


def add_tool_calls(part: dict[str, Any], events: ToolEvents, finish_reason: str | None) -> None:
    """A chat chunk's choice with its `delta.tool_calls` (OpenAI's entries: index, then id, type and name
    once, then argument fragments) and, at the end, the choice's finish reason ("tool_calls" after calls)."""
    delta = part["delta"]
    if "role" in delta and not delta.get("content"):
        delta["content"] = None
    if events.calls:
        delta["tool_calls"] = events.calls
    if part["finish_reason"] is not None:
        part["finish_reason"] = finish_reason


def model_list(name: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": created, "owned_by": "pdserve", "max_model_len": max_model_len}
    ]}
