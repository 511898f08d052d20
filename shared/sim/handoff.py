"""A disaggregated request's KV handoff as the live router and prefill engine run it
(services/router/dispatch.py, pdserve.engine.kv_parts): a prompt longer than the router's `kv_part_tokens`,
placed on a named decode replica, is prefilled in chunks of at most one part (whole blocks) and its KV leaves
in parts as they are computed, so only the tail after the last part moves once the prefill is done. The first
token reaches the client at the end of the prefill either way; the decode replica starts once the rest of the
KV is in."""

from __future__ import annotations

from dataclasses import dataclass


def part_tokens(kv_part_tokens: int, block_size: int) -> int:
    """Tokens per part: whole blocks, at least one (pdserve.engine.kv_parts.part_tokens)."""
    return max(1, -(-kv_part_tokens // block_size)) * block_size


@dataclass(frozen=True)
class Handoff:
    max_prefill_chunk: int | None  # the prefill engine's chunk cap for this sequence
    part_tokens: int | None = None  # None: the whole KV moves after the prefill

    def tail_tokens(self, prompt_tokens: int) -> int:
        """Tokens whose KV is left to move after the prefill: those after the last whole part (a part is taken
        after each step that leaves one computed and the prompt unfinished)."""
        if self.part_tokens is None:
            return prompt_tokens
        return prompt_tokens - self.part_tokens * ((prompt_tokens - 1) // self.part_tokens)


def plan_handoff(kv_part_tokens: int | None, placement_chunk: int | None, decode_named: bool,
                 prompt_tokens: int, block_size: int) -> Handoff:
    """The handoff the live router asks for: in parts only where the placement names the decode replica (parts
    need one) and the prompt is longer than a part; the engine caps its chunks at the part."""
    if kv_part_tokens is None or not decode_named or prompt_tokens <= kv_part_tokens:
        return Handoff(placement_chunk)
    part = part_tokens(kv_part_tokens, block_size)
    return Handoff(min(placement_chunk or part, part), part)
