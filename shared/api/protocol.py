"""OpenAI-compatible request types (validated) and their mapping onto engine SamplingParams.

Wire types only: no tensors, no engine imports beyond SamplingParams. The router validates with
these before anything reaches an engine, so bad input never allocates KV.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pdserve.api.messages import ChatMessage
from pdserve.api.tools import ToolChoice, ToolDefinition, ToolPlan, check_history, check_tool_choice, check_tools, \
    plan_tools
from pdserve.sampling_params import MAX_ABS_LOGIT_BIAS, SamplingParams
from pdserve.structured import JSON_OBJECT_SCHEMA, StructuredOutputError, check_json_schema

MAX_N = 16
MAX_STOP = 8
MAX_PROMPTS = 64  # prompts in one completions request (the router also bounds prompts x n)
MAX_LOGIT_BIAS = 300  # entries in logit_bias
MAX_INT32 = 2**31 - 1  # token ids and top_k: what the gRPC API's fields hold, and well within the worker codec's range


def _not_bool_or_str(value: Any) -> Any:
    if isinstance(value, (bool, str)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


# numbers and flags are what the OpenAPI document types them: true is not 1, 1 is not true, "1" is neither;
# an integer may be written 2.0 (JSON Schema's integer), not 2.5. (Bounds before the validator, so that they
# reach the JSON schema as minimum/maximum.)
_INT = BeforeValidator(_not_bool_or_str)
PositiveInt = Annotated[int, Field(ge=1), _INT]
NonNegativeInt = Annotated[int, Field(ge=0), _INT]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32), _INT]
NumLogprobs = Annotated[int, Field(ge=0, le=20), _INT]
Text = Annotated[str, Field(min_length=1)]
Tokens = Annotated[list[TokenId], Field(min_length=1)]


def has_lone_surrogates(value: Any) -> bool:
    """Whether any string in a parsed JSON value (keys included) holds a lone UTF-16 surrogate: JSON's
    \\ud800-\\udfff escapes parse into such strings, which no tokenizer or UTF-8 response can carry."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def unsupported(what: str, detail: str = "") -> PydanticCustomError:
    """A 400 whose param is the field validated and whose code is `unsupported_parameter`."""
    message = f"{what} is not supported by this server" + (f": {detail}" if detail else "")
    return PydanticCustomError("unsupported", message)


class StreamOptions(BaseModel):
    # other keys (include_obfuscation, ...) are accepted and ignored, as OpenAI-compatible servers do
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # usage on every chunk (vLLM extension; guidellm sends it)


class SLOOverride(BaseModel):
    """pdserve extension: this request's own SLOs (over the router's defaults)."""

    model_config = ConfigDict(extra="forbid")
    # at least a millisecond: a smaller one would underflow to a zero SLO in seconds
    ttft_ms: StrictFloat | None = Field(None, ge=1, le=3_600_000)
    tpot_ms: StrictFloat | None = Field(None, ge=1, le=60_000)


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: the output is JSON valid under `schema`, enforced whatever `strict` says."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=4096)
    # "schema" shadows a BaseModel attribute: the field is schema_, the wire name schema
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None

    @field_validator("schema_")
    @classmethod
    def _check_schema(cls, value):
        try:
            check_json_schema(value)
        except StructuredOutputError as exc:
            raise PydanticCustomError("json_schema", "this server cannot enforce the schema: {error}",
                                      {"error": str(exc)[:1000]}) from None
        return value


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or json_schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only with it')
        return self

    @property
    def schema_text(self) -> str | None:
        """The constraint for SamplingParams.json_schema (canonical JSON text); None for text."""
        if self.type == "json_object":
            return JSON_OBJECT_SCHEMA
        if self.json_schema is not None:
            return check_json_schema(self.json_schema.schema_)  # cached: checked at validation
        return None


class _SamplingFields(BaseModel):
    # extra="forbid" turns unknown fields into 400s instead of silently ignoring them
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, min_length=1, max_length=256)  # None: the served model (as vLLM does)
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    n: Annotated[int, Field(ge=1, le=MAX_N), _INT] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1), _INT] | None = None
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = Field(None, max_length=256)
    # vLLM-style extensions
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT32), _INT] = 0  # over the vocabulary: all of it
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: StrictBool = False
    min_tokens: NonNegativeInt = 0
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    # token id (a decimal string, as OpenAI's JSON keys are) -> bias added to its logit
    logit_bias: dict[str, StrictFloat] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # pdserve extensions: per-request SLOs and priority class (also as X-SLO-TTFT-Ms, X-SLO-TPOT-Ms,
    # X-Priority headers)
    slo: SLOOverride | None = None
    priority: Literal["interactive", "batch"] | None = None
    response_format: ResponseFormat | None = None  # structured outputs (chat and, as vLLM, completions)

    @model_validator(mode="before")
    @classmethod
    def _check_text(cls, data):
        if has_lone_surrogates(data):
            raise PydanticCustomError("text", "the body's strings must be Unicode text: a \\ud800-\\udfff escape "
                                      "must be half of a surrogate pair")
        return data

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP or any(not s or len(s) > 256 for s in stops):
            raise ValueError(f"at most {MAX_STOP} non-empty strings of at most 256 characters")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value):
        for key, bias in (value or {}).items():
            if not key.isdecimal():
                raise PydanticCustomError("logit_bias", "logit_bias keys must be token ids (decimal strings), "
                                          "got '{key}'", {"key": key[:32]})
            if not (math.isfinite(bias) and -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS):
                raise PydanticCustomError("logit_bias", "logit_bias values must be in [-100, 100], got {bias} "
                                          "for token {key}", {"bias": bias, "key": key})
        return value

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(
        self, default_max_tokens: int, num_logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        max_tokens = self.requested_max_tokens or default_max_tokens
        if self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
            top_k=max(self.top_k, 0), top_p=self.top_p, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, seed=self.seed, stop=stops,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, logprobs=num_logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=self.logit_bias_ids,
            json_schema=self.response_format.schema_text if self.response_format is not None else None,
        )

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


Prompt = (Text | Tokens | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
          | Annotated[list[Tokens], Field(min_length=1, max_length=MAX_PROMPTS)])
PROMPT_ERRORS = {  # the first of these error types among the prompt's (one union member's each) explains it
    "string_too_short": "prompt must not be empty (nor any prompt in a batch)",
    "too_short": "prompt must not be empty (nor any prompt in a batch)",
    "too_long": f"at most {MAX_PROMPTS} prompts per request",
    "greater_than_equal": "prompt token ids must be non-negative",
    "less_than_equal": f"prompt token ids must be at most {MAX_INT32}",
}


class CompletionRequest(_SamplingFields):
    prompt: Prompt = Field(..., description="a string, token ids, or a batch of either (choice index = "
                           "prompt index * n + j)")
    logprobs: NumLogprobs | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: PositiveInt | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value, handler):
        try:
            return handler(value)
        except ValidationError as exc:
            types = {e["type"] for e in exc.errors()}
            message = next((m for t, m in PROMPT_ERRORS.items() if t in types), "prompt must be a string, a list of "
                           "token ids, a list of strings or a list of token-id lists")
            raise PydanticCustomError("prompt", message) from None

    @field_validator("suffix")
    @classmethod
    def _refuse_suffix(cls, value):
        if value:
            raise unsupported("suffix")
        return value

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, value, info: ValidationInfo):
        n = info.data.get("n", 1)
        if value is not None and value != n:
            raise unsupported("best_of", f"only best_of equal to n ({n}) is accepted, got {value}")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: a single prompt is a batch of one."""
        p = self.prompt
        return p if isinstance(p, list) and not isinstance(p[0], int) else [p]

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        # echo with logprobs: the echoed prompt's tokens carry logprobs too, as OpenAI's legacy API does
        return self.sampling_params(default_max_tokens, self.logprobs, self.logprobs if self.echo else None)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    logprobs: StrictBool = False
    top_logprobs: NumLogprobs | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = Field(None, validate_default=True)  # default: auto with tools, else none
    parallel_tool_calls: StrictBool | None = None  # default: true

    @field_validator("messages")
    @classmethod
    def _check_history(cls, value):
        return check_history(value)

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value):
        return check_tools(value) if value else value

    @field_validator("tool_choice", mode="wrap")
    @classmethod
    def _check_tool_choice(cls, value, handler, info: ValidationInfo):
        try:
            value = handler(value)
        except ValidationError:
            raise PydanticCustomError("tool_choice", 'tool_choice must be "none", "auto", "required" or '
                                      '{"type": "function", "function": {"name": ...}}') from None
        formatted = info.data.get("response_format")
        return check_tool_choice(info.data.get("tools"), value, formatted is not None and formatted.type != "text")

    @property
    def tool_plan(self) -> ToolPlan | None:
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    @model_validator(mode="after")
    def _check_top_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        num = (self.top_logprobs or 0) if self.logprobs else None
        params = self.sampling_params(default_max_tokens, num)
        plan = self.tool_plan
        if plan is not None and plan.schema is not None:  # required or named: the output is the calls' JSON
            params = dataclasses.replace(params, json_schema=plan.schema)
        return params
