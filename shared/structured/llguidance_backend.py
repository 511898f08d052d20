"""llguidance (github.com/guidance-ai/llguidance): JSON schemas to token masks, on CPU, without torch.

It refuses what it cannot enforce (`uniqueItems`, `not`, `if`/`then`, unknown formats, ...) rather than
ignore it, and builds each mask lazily from a token trie shared by every copy of a compiled grammar.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import llguidance
import numpy as np

from pdserve.structured.backend import Grammar, GrammarBackend, Matcher, StructuredOutputError, Vocabulary, \
    clear_from
from pdserve.structured.config import StructuredConfig
from pdserve.structured.formats import bound_fraction_digits

_QUIET = 0  # llguidance log level: errors are read back with get_error(), not printed


def _options(max_whitespace: int) -> dict:
    # overrides, not defaults: a schema's own "x-guidance" cannot loosen them
    options: dict = {"lenient": False}  # an unimplemented keyword is an error, never silently dropped
    if max_whitespace:
        options |= {"whitespace_flexible": True, "whitespace_pattern": f"[ \\t\\n\\r]{{0,{max_whitespace}}}"}
    else:
        options |= {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return options


def _guarded(call, *args, **kwargs):
    """llguidance's result, with its errors as StructuredOutputError: a ValueError, and a Rust panic (pyo3's
    PanicException, a BaseException: seen on malformed schemas whose error message it truncates mid-character)."""
    try:
        return call(*args, **kwargs)
    except ValueError as exc:
        raise StructuredOutputError(str(exc)) from None
    except BaseException as exc:
        if type(exc).__name__ != "PanicException":
            raise
        raise StructuredOutputError(f"the schema broke the grammar engine ({str(exc)[:200]})") from None


def _grammar_text(schema: str, max_whitespace: int) -> str:
    return _guarded(llguidance.LLMatcher.grammar_from_json_schema, schema, overrides=_options(max_whitespace))


class LLGuidanceMatcher(Matcher):
    __slots__ = ("_matcher", "_num_tokens")

    def __init__(self, matcher: llguidance.LLMatcher, num_tokens: int) -> None:
        self._matcher = matcher
        self._num_tokens = num_tokens

    def consume(self, token_ids: Iterable[int]) -> bool:
        return all(self._matcher.consume_token(t) for t in token_ids)

    def validate(self, token_ids: Sequence[int]) -> int:
        return self._matcher.validate_tokens(list(token_ids))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._matcher.get_error()}")

    def forced_tokens(self) -> list[int]:
        return self._matcher.compute_ff_tokens()

    def fill_bitmask(self, row: np.ndarray) -> None:
        # the buffer must be exactly the mask's size (llguidance checks it) and contiguous
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        clear_from(row, self._num_tokens)

    @property
    def is_finished(self) -> bool:
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class LLGuidanceGrammar(Grammar):
    def __init__(self, template: llguidance.LLMatcher, num_tokens: int) -> None:
        self._template = template  # never advanced: each sequence takes a copy
        self._num_tokens = num_tokens

    def matcher(self) -> Matcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self._num_tokens)


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, config: StructuredConfig, vocab: Vocabulary) -> None:
        super().__init__(config, vocab)
        # ~0.3 s for a 49k vocabulary: built once per engine, on its first constrained request
        self._tokenizer = llguidance.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab.vocab_size,
                                                 eos_token=list(vocab.eos_token_ids))

    def compile(self, schema: str) -> Grammar:
        template = _guarded(llguidance.LLMatcher, self._tokenizer,
                            _grammar_text(bound_fraction_digits(schema, self.config.max_fraction_digits),
                                          self.config.max_whitespace), log_level=_QUIET)
        if template.is_error():
            raise StructuredOutputError(template.get_error())
        return LLGuidanceGrammar(template, min(self.vocab.num_tokens, self.vocab.vocab_size))

    @staticmethod
    def check(schema: str) -> None:
        # whitespace options do not change what compiles
        validate = llguidance.LLMatcher.validate_grammar_with_warnings
        has_error, messages = _guarded(validate, _grammar_text(schema, 0), None)
        if has_error or messages:
            raise StructuredOutputError("; ".join(messages) or "the schema does not compile")
