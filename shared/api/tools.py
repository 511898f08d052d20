"""Tool calling on the wire: function definitions, tool_choice, calls in the history, and the plan a request
carries to its response (which functions, whether the output is constrained to calls).

`required` and a named choice constrain the output to JSON through the structured-output path: one call
`{"name": ..., "arguments": {...}}` (the body of a `<tool_call>` block, see `tool_prompt`), or with
`parallel_tool_calls` a list of 1..MAX_PARALLEL_CALLS of them, each call's arguments under its function's
`parameters`. `auto` is not constrained: calls are parsed from the text in the model family's format (`call_formats`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.structured import StructuredOutputError, canonical_schema, check_json_schema
from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator
from pydantic_core import PydanticCustomError

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # calls in one constrained answer: a small model must not loop on calls to its budget
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
ToolMode = Literal["auto", "required"]


def _schema_error(exc: StructuredOutputError) -> PydanticCustomError:
    return PydanticCustomError("json_schema", "this server cannot enforce the schema: {error}",
                               {"error": str(exc)[:1000]})


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=4096)
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; absent: no arguments
    strict: StrictBool | None = None  # accepted: required/named calls are always enforced

    @field_validator("parameters")
    @classmethod
    def _check_parameters(cls, value):
        if value is None:
            return value
        if value.get("type", "object") != "object":
            raise PydanticCustomError("json_schema", "a function's parameters must be a JSON schema of type "
                                      "\"object\", got type {type}", {"type": json.dumps(value.get("type"))})
        try:
            check_json_schema(value)
        except StructuredOutputError as exc:
            raise _schema_error(exc) from None
        return value

    @property
    def parameters_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else NO_PARAMETERS


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(BaseModel):
    """tool_choice {"type": "function", "function": {"name": ...}}: exactly that function is called."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=65536)  # JSON text, as OpenAI returns it

    @field_validator("arguments")
    @classmethod
    def _check_arguments(cls, value):
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):  # deep nesting exhausts json's recursion
            raise PydanticCustomError("arguments", "arguments must be a JSON object's text") from None
        if not isinstance(parsed, dict):
            raise PydanticCustomError("arguments", "arguments must be a JSON object's text")
        return value


class ToolCall(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: CalledFunction


def check_tools(tools: list[ToolDefinition]) -> list[ToolDefinition]:
    names = [t.function.name for t in tools]
    if len(tools) > MAX_TOOLS:
        raise PydanticCustomError("tools", "at most {n} tools", {"n": MAX_TOOLS})
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise PydanticCustomError("tools", "function names must be unique: {name} is defined twice",
                                  {"name": duplicate})
    return tools


def check_tool_choice(tools: list[ToolDefinition] | None, choice: ToolChoice | None, formatted: bool):
    """`formatted`: the request asks for a JSON response_format, which excludes calls."""
    plan = plan_tools(tools, choice, None)
    if plan is not None and formatted:
        raise PydanticCustomError("tool_choice", "tool calls and a JSON response_format exclude each other: set "
                                  'tool_choice to "none" or drop response_format')
    return choice


def check_history(messages: list) -> list:
    """Each tool message answers a call an earlier assistant message made."""
    made: set[str] = set()
    for k, message in enumerate(messages):
        made.update(c.id for c in message.tool_calls or ())
        if message.role == "tool" and message.tool_call_id not in made:
            raise PydanticCustomError("messages", "messages[{k}] answers tool call {id}, which no earlier "
                                      "assistant message made", {"k": k, "id": json.dumps(message.tool_call_id)})
    return messages


@dataclass(frozen=True)
class ToolPlan:
    """What a response needs to know of a request's tools: its mode, the names it may call, and for
    `required` (a named choice is `required` over one function) the output schema's canonical text."""

    mode: ToolMode
    names: tuple[str, ...]
    parallel: bool
    schema: str | None = None
    call_format: str = "hermes"  # auto: how the model writes calls (pdserve.api.call_formats, from its template)


def call_schema(functions: list[FunctionDefinition], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a constrained answer: a call to one of `functions` (a list of calls if `parallel`)."""
    calls = [{"type": "object", "properties": {"name": {"const": f.name}, "arguments": f.parameters_schema},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if not parallel:
        return one
    return {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}


def plan_tools(tools: list[ToolDefinition] | None, choice: ToolChoice | None,
               parallel: bool | None) -> ToolPlan | None:
    """The request's plan (None: no tools in play, the output is plain text); raises PydanticCustomError
    for a choice that names no defined function or needs tools where none are given."""
    functions = [t.function for t in tools or ()]
    if choice is None:
        choice = "auto" if functions else "none"
    if choice == "none":
        return None
    if not functions:
        raise PydanticCustomError("tool_choice", "tool_choice {choice} needs tools", {"choice": json.dumps(
            choice if isinstance(choice, str) else choice.model_dump())})
    parallel = True if parallel is None else parallel
    names = tuple(f.name for f in functions)
    if choice == "auto":
        return ToolPlan("auto", names, parallel)
    if isinstance(choice, NamedToolChoice):
        chosen = [f for f in functions if f.name == choice.function.name]
        if not chosen:
            raise PydanticCustomError("tool_choice", "tool_choice names function {name}, which tools does not "
                                      "define (defined: {names})", {"name": json.dumps(choice.function.name),
                                                                    "names": ", ".join(names)})
        functions = chosen
    schema = call_schema(functions, parallel)
    try:
        text = check_json_schema(schema)
    except StructuredOutputError as exc:
        raise _schema_error(exc) from None
    return ToolPlan("required", tuple(f.name for f in functions), parallel, text)


def tool_json(tool: ToolDefinition) -> str:
    """A definition as the prompt shows it (canonical JSON, unset fields left out)."""
    return canonical_schema(tool.model_dump(exclude_none=True))
