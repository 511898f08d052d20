"""Tools into the prompt: by the chat template when it reads `tools`, else by our default format.

The default format is Hermes/Qwen2.5's: a system section lists the functions as JSON inside <tools>, a call
is a `<tool_call>` block holding `{"name": ..., "arguments": {...}}`, and a tool's result goes back as a user
turn holding a `<tool_response>` block (any template renders a user turn). Assistant calls in the history are
rendered as the same blocks, so the model sees its own format.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.meta
from pdserve.api.call_formats import detect
from pdserve.api.tools import ToolDefinition, ToolPlan, tool_json

if TYPE_CHECKING:
    from pdserve.api.messages import ChatMessage

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query. The functions, as JSON "
    "signatures within <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nTo call a function, answer with one "
    "block per call, each holding a JSON object with the function's name and its arguments:\n"
    f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n{CALL_CLOSE}'
)
MUST = {"required": "\n\nYou must call at least one function.", "named": "\n\nYou must call the function {name}."}


@lru_cache(maxsize=8)
def template_reads_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads a `tools` variable)."""
    if not template:
        return False
    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateError:
        return False


def call_format_of(template: str | None) -> str:
    """The call format a model answers in under `render`: its template's, or the default section's."""
    return detect(template, template_reads_tools(template))


def tools_section(tools: list[ToolDefinition], plan: ToolPlan | None) -> str:
    text = TOOLS_HEADER.replace("{tools}", "\n".join(tool_json(t) for t in tools))
    if plan is not None and plan.mode == "required":
        text += MUST["named"].format(name=plan.names[0]) if len(plan.names) < len(tools) else MUST["required"]
    return text


def call_block(name: str, arguments: str) -> str:
    return f'{CALL_OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}\n{CALL_CLOSE}'


def _default_message(message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message.text}\n</tool_response>"}
    out = message.for_template()
    if message.tool_calls:
        blocks = [call_block(c.function.name, c.function.arguments) for c in message.tool_calls]
        out["content"] = "\n".join(([out["content"]] if out["content"] else []) + blocks)
    return out


def _template_message(message: ChatMessage) -> dict[str, Any]:
    out: dict[str, Any] = message.for_template()
    if message.tool_calls:  # HF templates read arguments as a mapping
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def render(messages: list[ChatMessage], tools: list[ToolDefinition] | None, plan: ToolPlan | None,
           template: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables) for `Tokenizer.apply_chat_template`. Tools are shown only when
    `plan` is set (tool_choice none hides them); history calls and results are always rendered."""
    if template_reads_tools(template):
        extra = {"tools": [t.model_dump(exclude_none=True) for t in tools]} if plan is not None and tools else {}
        return [_template_message(m) for m in messages], extra
    out = [_default_message(m) for m in messages]
    if plan is not None and tools:
        section = tools_section(tools, plan)
        if out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, {}
