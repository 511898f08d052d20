"""Disaggregate-or-skip decision: a pure function of the request and the config."""

from __future__ import annotations

from typing import NamedTuple


class Decision(NamedTuple):
    disaggregate: bool
    reason: str


def decide(mode: str, num_prompt_tokens: int, min_prompt_tokens: int, has_prefill: bool) -> Decision:
    if mode == "colocated":
        return Decision(False, "colocated")
    if not has_prefill:
        return Decision(False, "no_prefill_pool")
    if num_prompt_tokens < min_prompt_tokens:
        return Decision(False, "short_prompt")
    return Decision(True, "long_prompt")
