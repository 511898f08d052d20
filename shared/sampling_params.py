"""Per-request sampling parameters (validated, immutable)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

MAX_ABS_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs; 0 = sampled token only
    # per prompt position: logprob of the prompt token and this many top alternatives; None = off
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # (token id, bias added to its logit), sorted by token id; a mapping is accepted and normalized
    logit_bias: tuple[tuple[int, float], ...] = ()
    # structured output: the text must be JSON valid under this schema (canonical JSON text, as
    # pdserve.structured.canonical_schema writes it; plain data so it crosses Ray, the worker link and
    # the handoff); None: unconstrained
    json_schema: str | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in bias)))
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables)"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0"),
            (all(t >= 0 and math.isfinite(b) and abs(b) <= MAX_ABS_LOGIT_BIAS for t, b in self.logit_bias),
             "logit_bias: token ids must be >= 0 and biases in [-100, 100]"),
            (len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias: a token id appears twice"),
            (self.json_schema is None or (isinstance(self.json_schema, str) and self.json_schema.startswith("{")),
             "json_schema must be a JSON object's text"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """Plain data for crossing process boundaries (Serve handle calls); `extra` stays local."""
    return {f.name: getattr(params, f.name) for f in fields(params) if f.name != "extra"}


def params_from_dict(data: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**data)  # validated in __post_init__
