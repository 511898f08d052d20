"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens
(a span that runs into the end of the sequence continues periodically)."""

from __future__ import annotations

from collections.abc import Sequence as Tokens

from pdserve.config import SpeculativeConfig
from pdserve.engine.spec.proposer import Proposer


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        return cls(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, token_ids: Tokens[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        length = len(token_ids)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            start = _latest_match(token_ids, n)
            if start is not None:
                proposal = list(token_ids[start + n : start + n + max_tokens])
                # a match close to the end is a repeating span: continue it with its own period
                period = len(proposal)
                while len(proposal) < max_tokens:
                    proposal.append(proposal[len(proposal) - period])
                return proposal
        return []


def _latest_match(token_ids: Tokens[int], n: int) -> int | None:
    """Start of the latest occurrence of the last n tokens that ends before the last token."""
    length = len(token_ids)
    pattern = list(token_ids[length - n :])
    first = pattern[0]
    for start in range(length - n - 1, -1, -1):
        if token_ids[start] == first and list(token_ids[start : start + n]) == pattern:
            return start
    return None
