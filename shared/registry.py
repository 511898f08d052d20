"""Name -> "module:attribute" registries whose entries import only when chosen (optional dependencies)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def load(registry: Mapping[str, str], name: str, kind: str) -> Any:
    """The attribute `registry[name]` points at; ValueError naming the known entries if there is none."""
    try:
        module, _, attr = registry[name].partition(":")
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; known: {sorted(registry)}") from None
    return getattr(importlib.import_module(module), attr)
