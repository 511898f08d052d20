"""Draft proposers: the contract, and the registry of methods."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Tokens

from pdserve.config import SpeculativeConfig
from pdserve.registry import load

PROPOSERS = {"ngram": "pdserve.engine.spec.ngram:NgramProposer"}


class Proposer(ABC):
    """Guesses the next tokens of a sequence; the target model verifies them, so a guess only costs time.

    `propose(token_ids, max_tokens)` sees prompt + output so far and returns at most `max_tokens` token
    ids (possibly none). It must be a pure function of its inputs: a seeded request's drafts, and so its
    tokens, then repeat from run to run.
    """

    @abstractmethod
    def propose(self, token_ids: Tokens[int], max_tokens: int) -> list[int]: ...


def create_proposer(config: SpeculativeConfig) -> Proposer:
    return load(PROPOSERS, config.method, "speculative method").from_config(config)
