"""The engine's side: response formats to per-sequence matchers, compiled grammars cached by schema."""

from __future__ import annotations

import time
from collections import OrderedDict

from pdserve.structured.backend import Grammar, GrammarBackend, Matcher, Vocabulary, create_backend
from pdserve.structured.config import StructuredConfig


class GrammarCompiler:
    """A backend over one vocabulary, and a bounded LRU of its grammars keyed by canonical schema text
    (`formats.canonical_schema`: key order kept, since it orders the generated properties)."""

    def __init__(self, config: StructuredConfig, vocab: Vocabulary) -> None:
        self.config = config
        self.backend: GrammarBackend = create_backend(config, vocab)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self.num_hits = 0
        self.num_compiles = 0
        self.compile_time_s = 0.0  # summed over cold compiles

    def grammar(self, schema: str) -> Grammar:
        """Raises StructuredOutputError (nothing is cached then)."""
        grammar = self._cache.get(schema)
        if grammar is not None:
            self._cache.move_to_end(schema)
            self.num_hits += 1
            return grammar
        start = time.perf_counter()
        grammar = self.backend.compile(schema)
        self.compile_time_s += time.perf_counter() - start
        self.num_compiles += 1
        self._cache[schema] = grammar
        if len(self._cache) > self.config.max_cached_grammars:
            self._cache.popitem(last=False)
        return grammar

    def matcher(self, schema: str, replay: tuple[int, ...] = ()) -> Matcher:
        """A fresh matcher, advanced over `replay` (output already generated, e.g. prefill's first token or a
        migrated stream's): ValueError when those tokens do not follow the schema."""
        matcher = self.grammar(schema).matcher()
        if replay and not matcher.consume(replay):
            raise ValueError(f"the tokens generated so far do not follow the response format: {matcher.error}")
        return matcher

    @property
    def num_cached(self) -> int:
        return len(self._cache)
