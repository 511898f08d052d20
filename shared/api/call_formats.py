"""How a model family writes tool calls in free text (`tool_choice: auto`), chosen from its chat template.

- `hermes` (Hermes, Qwen2.5, and pdserve's default rendering for templates without tools): each call is a
  `<tool_call>` block holding `{"name": ..., "arguments": {...}}`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`, to the end of the text.
- `llama3_json` (Llama 3.1 / 3.2 with JSON tools): the answer is `{"name": ..., "parameters": {...}}`, several
  joined by `;`, either as the whole text or after `<|python_tag|>`.

A block that does not parse as calls to defined functions stays content, as written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

Call = tuple[str, dict[str, Any]]  # (function name, arguments)


@dataclass(frozen=True)
class CallFormat:
    name: str
    open: str  # the marker a block of calls starts with
    close: str | None  # the marker it ends with; None: the block runs to the end of the text
    bare_json: bool = False  # the text may also be the block itself when it starts (after blanks) with "{"
    arguments_key: str = "arguments"
    calls_in: str = "object"  # what a body holds: "object" (one call), "list" (of calls), "semicolons" (joined)

    def parse(self, body: str, names: tuple[str, ...]) -> list[Call] | None:
        """The calls a block's body holds, or None when it is not only calls to functions in `names`."""
        values = self._values(body)
        if not values:
            return None
        calls = []
        for value in values:
            if not (isinstance(value, dict) and set(value) == {"name", self.arguments_key}
                    and value["name"] in names and isinstance(value[self.arguments_key], dict)):
                return None
            calls.append((value["name"], value[self.arguments_key]))
        return calls

    def _values(self, body: str) -> list[Any] | None:
        try:
            if self.calls_in == "semicolons":
                return [json.loads(part) for part in body.split(";") if part.strip()]
            value = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if self.calls_in == "list":
            return value if isinstance(value, list) else None
        return [value]


FORMATS = {
    "hermes": CallFormat("hermes", "<tool_call>", "</tool_call>"),
    "mistral": CallFormat("mistral", "[TOOL_CALLS]", None, calls_in="list"),
    "llama3_json": CallFormat("llama3_json", "<|python_tag|>", None, bare_json=True, arguments_key="parameters",
                              calls_in="semicolons"),
}
DEFAULT_FORMAT = "hermes"
# markers a template's text holds -> the format its model writes, checked in this order
_SIGNATURES = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"))


def call_format(name: str) -> CallFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool call format {name!r}; known: {', '.join(FORMATS)}") from None


def detect(template: str | None, template_reads_tools: bool) -> str:
    """The format a model writes calls in: its template's, when the template renders tools itself and names a
    known marker; else the default (the one pdserve's own tools section teaches)."""
    if template and template_reads_tools:
        for marker, name in _SIGNATURES:
            if marker in template:
                return name
    return DEFAULT_FORMAT
