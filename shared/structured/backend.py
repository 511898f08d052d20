"""The grammar engine's contract: a backend compiles a JSON schema for one tokenizer; a matcher is one
sequence's position in that grammar. Backends register by name and import only when chosen."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.registry import load
from pdserve.structured.config import StructuredConfig

BACKENDS = {"llguidance": "pdserve.structured.llguidance_backend:LLGuidanceBackend"}


class StructuredOutputError(ValueError):
    """A response format the backend cannot enforce: it does not compile, or it uses a keyword the
    backend would otherwise ignore. The message says which."""


@dataclass(frozen=True)
class Vocabulary:
    """What a backend needs of the tokenizer and the model."""

    tokenizer_json: str = field(repr=False)  # the tokenizer's tokenizer.json text
    num_tokens: int  # the tokenizer's ids are [0, num_tokens)
    vocab_size: int  # the model's logits width: may exceed num_tokens (ids no text can spell)
    eos_token_ids: tuple[int, ...]  # end a sequence whose value is complete


class Matcher(ABC):
    """One sequence's grammar state. Tokens are consumed in order; a finished matcher accepts nothing
    more (its value is complete), so the sequence stops there."""

    @abstractmethod
    def consume(self, token_ids: Iterable[int]) -> bool:
        """Advance over `token_ids`; False (and the matcher is in error) when one is not allowed."""

    @abstractmethod
    def validate(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of `token_ids` the grammar accepts from here; the matcher does not move."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` consumed (a speculative draft's walk)."""

    @abstractmethod
    def forced_tokens(self) -> list[int]:
        """A tokenization of the text the grammar forces next (possibly empty): a draft that always validates."""

    @abstractmethod
    def fill_bitmask(self, row: np.ndarray) -> None:
        """Write the tokens allowed next into `row` (int32 [ceil(vocab_size / 32)]): bit t % 32 of word
        t // 32 is set iff token t is allowed. Ids past the tokenizer's vocabulary are never allowed."""

    @property
    @abstractmethod
    def is_finished(self) -> bool: ...

    @property
    @abstractmethod
    def error(self) -> str | None: ...


class Grammar(ABC):
    """A compiled schema: immutable, shared by every sequence that asks for it."""

    @abstractmethod
    def matcher(self) -> Matcher: ...


class GrammarBackend(ABC):
    """Compiles JSON schemas (canonical JSON text) into grammars over one vocabulary."""

    def __init__(self, config: StructuredConfig, vocab: Vocabulary) -> None:
        self.config = config
        self.vocab = vocab

    @abstractmethod
    def compile(self, schema: str) -> Grammar:
        """Raises StructuredOutputError naming what cannot be enforced."""

    @staticmethod
    @abstractmethod
    def check(schema: str) -> None:
        """The tokenizer-free part of compile (the router's validation): StructuredOutputError or None."""


def backend_class(name: str) -> type[GrammarBackend]:
    return load(BACKENDS, name, "structured output backend")


def create_backend(config: StructuredConfig, vocab: Vocabulary) -> GrammarBackend:
    return backend_class(config.backend)(config, vocab)


def words_for(vocab_size: int) -> int:
    """int32 words in a bitmask row over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def clear_from(row: np.ndarray, token_id: int) -> None:
    """Disallow every token id >= `token_id` in a bitmask row."""
    word, bit = divmod(token_id, 32)
    if word < len(row):
        row[word] &= np.int32((1 << bit) - 1)
        row[word + 1 :] = 0


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows, ascending."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab_size])
