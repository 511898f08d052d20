"""Response formats as the API states them, checked and made canonical on the router (torch-free)."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from pdserve.structured.backend import StructuredOutputError, backend_class
from pdserve.structured.config import DEFAULT_BACKEND

JSON_OBJECT_SCHEMA = '{"type":"object"}'  # response_format {"type": "json_object"}: any one JSON object
MAX_SCHEMA_DEPTH = 64  # JSON nesting levels of a schema (llguidance's own parser stops at 128)


def canonical_schema(schema: dict[str, Any]) -> str:
    """Compact JSON text, keys in the order given (property order is output order): the value that travels
    in SamplingParams.json_schema and keys the compiled-grammar cache."""
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def check_json_schema(schema: Any, backend: str = DEFAULT_BACKEND) -> str:
    """The canonical text of a schema the backend can enforce, or StructuredOutputError saying why not."""
    if not isinstance(schema, dict):
        raise StructuredOutputError("the schema must be a JSON object")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        text = canonical_schema(schema)
    except ValueError as exc:  # NaN / Infinity: not JSON
        raise StructuredOutputError(str(exc)) from None
    error = _check(text, backend)
    if error is not None:
        raise StructuredOutputError(error)
    return text


@lru_cache(maxsize=256)
def _check(text: str, backend: str) -> str | None:
    try:
        backend_class(backend).check(text)
    except StructuredOutputError as exc:
        return str(exc)
    return None


_VALUE_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # their values are data, not schemas


def bound_fraction_digits(schema: str, digits: int | None) -> str:
    """`schema` (canonical text) with `multipleOf: 10^-digits` on every number schema that has no multipleOf:
    the values it admits are a subset of the original's, each with at most `digits` fraction digits."""
    if digits is None or '"number"' not in schema:
        return schema
    value = json.loads(schema)
    step = float(f"1e-{digits}")
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            kind = item.get("type")
            if (kind == "number" or isinstance(kind, list) and "number" in kind) and "multipleOf" not in item:
                item["multipleOf"] = step
            stack.extend(v for k, v in item.items() if k not in _VALUE_KEYWORDS)
    return canonical_schema(value)


def _depth(value: Any) -> int:
    """JSON nesting levels of a parsed value (iterative: a deep value must not exhaust Python's stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level <= MAX_SCHEMA_DEPTH:  # no need to walk further than the bound
                stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
