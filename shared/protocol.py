"""OpenAI-compatible request types (validated) and their mapping onto engine SamplingParams.

Wire types only: no tensors, no engine imports beyond SamplingParams. The router validates with
these before anything reaches an engine, so bad input never allocates KV.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdserve.sampling_params import SamplingParams

MAX_N = 16
MAX_STOP = 8


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SLOOverride(BaseModel):
    """pdserve extension: this request's own SLOs (over the router's defaults)."""

    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(None, gt=0, le=3_600_000)
    tpot_ms: float | None = Field(None, gt=0, le=60_000)


class _SamplingFields(BaseModel):
    # extra="forbid" turns unknown fields into 400s instead of silently ignoring them
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = Field(None, max_length=256)
    # vLLM-style extensions
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    # pdserve extensions: per-request SLOs and priority class (also as X-SLO-TTFT-Ms, X-SLO-TPOT-Ms,
    # X-Priority headers)
    slo: SLOOverride | None = None
    priority: Literal["interactive", "batch"] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP or any(not s or len(s) > 256 for s in stops):
            raise ValueError(f"stop: at most {MAX_STOP} non-empty strings of at most 256 characters")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_ids(cls, value):
        if value and any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be non-negative")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, default_max_tokens: int, num_logprobs: int | None) -> SamplingParams:
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
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] = Field(...)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: Literal[False] = False
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value):
        if (isinstance(value, str) and not value) or (isinstance(value, list) and not value):
            raise ValueError("prompt must not be empty")
        if isinstance(value, list) and any(t < 0 for t in value):
            raise ValueError("prompt token ids must be non-negative")
        return value

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return self.sampling_params(default_max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str
    name: str | None = Field(None, max_length=64)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _check_top_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        num = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(default_max_tokens, num)
