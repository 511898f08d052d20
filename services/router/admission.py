"""From an HTTP request to a validated, tokenized request, or an APIError; no engine is touched here."""

from __future__ import annotations

import dataclasses
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve.models.tokenizer import Tokenizer
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.api import tool_prompt
from pdserve.api.contract import Priority
from pdserve.api.tools import ToolPlan
from pdserve.sampling_params import SamplingParams
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.errors import APIError, bad_request, from_validation_error
from pydantic import ValidationError
from starlette.requests import Request


@dataclass(frozen=True)
class Prepared:
    """An admitted request: `prompts` (token ids, one entry per prompt) with `n` choices each; choice
    `c` is choice `c % n` of prompt `c // n` (OpenAI's prompt-major order)."""

    chat: bool
    prompts: tuple[tuple[int, ...], ...]
    params: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    want_logprobs: bool
    ttft_slo_s: float
    tpot_slo_s: float
    priority: Priority
    continuous_usage: bool = False  # usage on every stream chunk
    echo_texts: tuple[str, ...] = ()  # one per prompt when echo is on: prepended to each choice's text
    tools: ToolPlan | None = None  # chat with tools in play: the choices' text is parsed for calls

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The first prompt (the whole request when it has one prompt, as chat and gRPC always do)."""
        return self.prompts[0]

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    def prompt_of(self, choice: int) -> int:
        return choice // self.n

    def echo_of(self, choice: int) -> str:
        return self.echo_texts[choice // self.n] if self.echo_texts else ""

    def echo_ids_of(self, choice: int) -> tuple[int, ...]:
        """The prompt tokens whose logprobs lead the choice's (echo with logprobs), else ()."""
        return self.prompts[choice // self.n] if self.echo_texts and self.want_logprobs else ()

    def params_for(self, choice: int) -> SamplingParams:
        """Choice j of a prompt samples with seed + j, so n choices differ yet stay reproducible, and a
        prompt in a batch samples as it would alone."""
        j = choice % self.n
        if self.params.seed is None or j == 0:
            return self.params
        return dataclasses.replace(self.params, seed=(self.params.seed + j) % 2**63)


def check_auth(request: Request, keys: tuple[str, ...]) -> None:
    check_authorization(request.headers.get("authorization", ""), keys)


def check_authorization(header: str, keys: tuple[str, ...]) -> None:
    """`header` is the Authorization value (HTTP header or gRPC metadata); raises APIError(401)."""
    if not keys:
        return
    scheme, _, token = header.partition(" ")
    token = token.strip().encode()
    # compare against every key, always, so timing says nothing about which key (or prefix) matched
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token, key.encode())
    if scheme.lower() != "bearer" or not ok:
        raise APIError(401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'",
                       code="invalid_api_key", reason="unauthorized")


async def read_json(request: Request, max_bytes: int) -> dict[str, Any]:
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json":
        raise bad_request(f"Content-Type must be application/json, got {content_type or 'none'!r}",
                          reason="content_type")
    too_large = APIError(413, f"request body exceeds {max_bytes} bytes", code="request_too_large",
                         reason="body_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise too_large
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}", reason="malformed_json") from None
    if not isinstance(data, dict):
        raise bad_request("the JSON body must be an object", reason="malformed_json")
    return data


def prepare(
    data: dict[str, Any], chat: bool, config: RouterConfig, tokenizer: Tokenizer, vocab_size: int
) -> Prepared:
    try:
        req = ChatCompletionRequest.model_validate(data) if chat else CompletionRequest.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    if req.model is not None and req.model != config.served_model_name:
        raise APIError(404, f"The model '{req.model}' does not exist; this server serves "
                       f"'{config.served_model_name}'", param="model", code="model_not_found",
                       reason="unknown_model")
    num_prompts = 1 if chat else len(req.prompts)
    if num_prompts * req.n > config.max_choices_per_request:
        raise bad_request(f"{num_prompts} prompts x n={req.n} is {num_prompts * req.n} choices, more than the "
                          f"{config.max_choices_per_request} allowed per request", param="prompt",
                          reason="too_many_choices")
    prompts = _tokenize(req, tokenizer, vocab_size)
    bad_bias = [t for t in req.logit_bias_ids if t >= vocab_size]
    if bad_bias:
        raise bad_request(f"logit_bias token id {bad_bias[0]} is out of the vocabulary (size {vocab_size})",
                          param="logit_bias", reason="token_out_of_vocab")
    longest = max(len(ids) for ids in prompts)
    requested = req.requested_max_tokens
    max_tokens = requested if requested is not None else min(config.default_max_tokens, config.max_model_len - longest)
    if max_tokens < 1 or longest + max_tokens > config.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {config.max_model_len} tokens; the prompt has "
            f"{longest} tokens and max_tokens is {max_tokens} ({longest + max_tokens} in all)",
            param="max_tokens", reason="context_length",
        )
    try:
        params = dataclasses.replace(req.to_sampling_params(config.default_max_tokens), max_tokens=max_tokens)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    options = req.stream_options
    echo_texts = ()
    if not chat and req.echo:
        echo_texts = tuple(p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False)
                           for p in req.prompts)
    slo = req.slo
    ttft_s = slo.ttft_ms / 1e3 if slo and slo.ttft_ms else config.slo_ttft_s
    tpot_s = slo.tpot_ms / 1e3 if slo and slo.tpot_ms else config.slo_tpot_s
    return Prepared(chat, prompts, params, req.n, req.stream, bool(options and options.include_usage),
                    params.logprobs is not None, ttft_s, tpot_s, Priority.of(req.priority or "interactive"),
                    continuous_usage=bool(options and options.continuous_usage_stats), echo_texts=echo_texts,
                    tools=_with_call_format(req.tool_plan, tokenizer) if chat else None)


def _with_call_format(plan: ToolPlan | None, tokenizer: Tokenizer) -> ToolPlan | None:
    if plan is None:
        return None
    return dataclasses.replace(plan, call_format=tool_prompt.call_format_of(tokenizer.chat_template))


SLO_HEADERS = {"x-slo-ttft-ms": "ttft_ms", "x-slo-tpot-ms": "tpot_ms"}


def merge_slo_headers(data: dict[str, Any], headers) -> dict[str, Any]:
    """X-SLO-TTFT-Ms / X-SLO-TPOT-Ms / X-Priority headers, where the body does not say otherwise;
    the merged body is validated like any other (a bad header value is a 400 on `slo` or `priority`)."""
    slo = {}
    for header, key in SLO_HEADERS.items():
        if (value := headers.get(header)) is not None:
            try:
                slo[key] = float(value)
            except ValueError:
                raise bad_request(f"{header} must be a number of milliseconds, got {value!r}", param="slo") from None
    if slo:
        given = data.get("slo")
        data = {**data, "slo": {**slo, **given} if isinstance(given, dict) else given if given is not None else slo}
    if (priority := headers.get("x-priority")) is not None and "priority" not in data:
        data = {**data, "priority": priority}
    return data


def _tokenize(
    req: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer, vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    if isinstance(req, ChatCompletionRequest):
        messages, extra = tool_prompt.render(req.messages, req.tools, req.tool_plan, tokenizer.chat_template)
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
        except ValueError as exc:
            raise bad_request(str(exc), param="messages") from None
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise bad_request("the prompt is empty after tokenization", param="messages")
        return (ids,)
    batch = len(req.prompts) > 1
    out = []
    for i, prompt in enumerate(req.prompts):
        where = f"prompt {i}" if batch else "the prompt"
        if isinstance(prompt, str):
            ids = tuple(tokenizer.encode(prompt))
        else:
            bad = [t for t in prompt if t >= vocab_size]
            if bad:
                raise bad_request(f"{where}: token id {bad[0]} is out of the vocabulary (size {vocab_size})",
                                  param="prompt", reason="token_out_of_vocab")
            ids = tuple(prompt)
        if not ids:
            raise bad_request(f"{where} is empty after tokenization", param="prompt")
        out.append(ids)
    return tuple(out)


class Admission:
    """Everything a request must pass before it touches a replica, in one call per API: the API key, the
    body (size, JSON, the SLO headers), validation and tokenization, and room in flight. Raises APIError."""

    def __init__(self, config: RouterConfig, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.api_keys = config.resolved_api_keys()

    def authorize(self, authorization: str) -> None:
        check_authorization(authorization, self.api_keys)

    async def http(self, request: Request, chat: bool, num_inflight: int) -> Prepared:
        self.authorize(request.headers.get("authorization", ""))
        data = merge_slo_headers(await read_json(request, self.config.max_body_bytes), request.headers)
        return self.admit(data, chat, num_inflight)

    def grpc(self, authorization: str, num_bytes: int, body: Callable[[], tuple[dict[str, Any], bool]],
             num_inflight: int) -> Prepared:
        """`body()`: the request as an OpenAI body and whether it is a chat, read only after the size check."""
        self.authorize(authorization)
        if num_bytes > self.config.max_body_bytes:
            raise APIError(413, f"request exceeds {self.config.max_body_bytes} bytes",
                           code="request_too_large", reason="body_too_large")
        data, chat = body()
        return self.admit(data, chat, num_inflight)

    def admit(self, data: dict[str, Any], chat: bool, num_inflight: int) -> Prepared:
        prepared = prepare(data, chat, self.config, self.tokenizer, self.vocab_size)
        if num_inflight >= self.config.max_inflight:
            raise APIError(429, f"too many requests in flight ({self.config.max_inflight}); retry later",
                           code="too_many_requests", reason="overloaded",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        return prepared

