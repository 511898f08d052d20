"""Structured outputs: response formats compiled into grammars whose token masks constrain sampling.

Torch-free, so the router checks schemas with the backend the engines use. The engine builds a
`GrammarCompiler` (backend + cache) and gives each constrained sequence a `Matcher`; the batched
sampler masks logits with `pdserve.structured.bitmask` (torch, imported by the engine only).
Backends register in BACKENDS by name (`StructuredConfig.backend`).
"""

from pdserve.structured.backend import BACKENDS, Grammar, GrammarBackend, Matcher, StructuredOutputError, \
    Vocabulary, create_backend
from pdserve.structured.compiler import GrammarCompiler
from pdserve.structured.config import StructuredConfig
from pdserve.structured.formats import JSON_OBJECT_SCHEMA, canonical_schema, check_json_schema

__all__ = [
    "BACKENDS", "JSON_OBJECT_SCHEMA", "Grammar", "GrammarBackend", "GrammarCompiler", "Matcher",
    "StructuredConfig", "StructuredOutputError", "Vocabulary", "canonical_schema", "check_json_schema",
    "create_backend",
]
