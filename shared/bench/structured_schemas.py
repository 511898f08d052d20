"""The schemas `pdserve bench structured` samples: 20 shapes applications send (flat records, enums,
bounded arrays, nested objects, numbers with ranges, optional fields, anyOf, patterns), each bounded so
a small model's output fits in the bench's max_tokens, and one long schema for timing decode steps."""

from __future__ import annotations

import json
from typing import Any


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


S = {"type": "string", "maxLength": 24}
INT = {"type": "integer", "minimum": 0, "maximum": 1000}

SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": S, "age": {"type": "integer", "minimum": 18, "maximum": 99}}),
    _obj({"city": S, "country": S, "population": INT}),
    _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]}, "confidence": {"type": "number", "minimum": 0,
                                                                                       "maximum": 1}}),
    _obj({"title": S, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1,
                               "maxItems": 3}}),
    _obj({"name": S, "address": _obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    _obj({"done": {"type": "boolean"}, "task": S}),
    _obj({"answer": {"enum": ["yes", "no"]}, "reason": S}),
    _obj({"items": {"type": "array", "items": _obj({"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}),
                    "minItems": 1, "maxItems": 2}}),
    _obj({"x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10,
                                                                       "maximum": 10}}),
    _obj({"language": {"enum": ["python", "rust", "go", "c"]}, "version": S}),
    _obj({"first": S, "last": S, "nickname": S}, required=["first", "last"]),
    _obj({"status": {"const": "ok"}, "code": {"type": "integer", "minimum": 100, "maximum": 599}}),
    _obj({"event": S, "when": _obj({"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                    "month": {"type": "integer", "minimum": 1, "maximum": 12}})}),
    _obj({"scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 3,
                     "maxItems": 3}}),
    _obj({"color": {"enum": ["red", "green", "blue"]}, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 8}]}}),
    _obj({"author": _obj({"name": S, "email": {"type": "string", "maxLength": 32}}), "stars": {"type": "integer",
                                                                                            "minimum": 1, "maximum": 5}}),
    _obj({"unit": {"enum": ["C", "F"]}, "temperature": {"type": "number", "minimum": -50, "maximum": 60}}),
    _obj({"question": S, "options": {"type": "array", "items": S, "minItems": 2, "maxItems": 4}}),
    _obj({"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "active": {"type": "boolean"}, "level": INT}),
]

# decode timing: 64 integers, so every sequence decodes far past the timed steps
LONG_SCHEMA = json.dumps(_obj({"values": {"type": "array", "items": INT, "minItems": 64, "maxItems": 64}}))


def prompt_for(schema: dict[str, Any]) -> str:
    fields = ", ".join(schema["properties"])
    return f"Invent an example and answer with one JSON object with the fields: {fields}."
