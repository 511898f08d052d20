"""Structured outputs' engine settings (torch-free: the router reads the backend name too)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BACKEND = "llguidance"


@dataclass(frozen=True)
class StructuredConfig:
    backend: str = DEFAULT_BACKEND
    max_cached_grammars: int = 128  # compiled grammars kept, by schema (least recently used goes first)
    # longest run of free whitespace between JSON tokens; 0: none, only the separators ", " and ": "
    # (json.dumps' defaults), so a small model cannot spend its budget on blanks
    max_whitespace: int = 0
    # fraction digits of a "number" whose schema has no multipleOf (as if it said multipleOf 10^-n), so a
    # sampled number cannot run to max_tokens; None: unbounded, as the schema says
    max_fraction_digits: int | None = 6

    def __post_init__(self) -> None:
        if self.max_cached_grammars < 1:
            raise ValueError("max_cached_grammars must be >= 1")
        if not 0 <= self.max_whitespace <= 64:
            raise ValueError("max_whitespace must be in [0, 64]")
        if self.max_fraction_digits is not None and not 0 <= self.max_fraction_digits <= 16:
            raise ValueError("max_fraction_digits must be in [0, 16] or None")
