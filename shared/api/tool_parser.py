"""Tool calls out of a choice's text, incrementally: one `ToolCallStream` per choice turns text pieces into
content and call events; a whole response is the same stream fed once, so streamed and whole answers agree.

- `required` (and named): the text is the constrained JSON (`pdserve.api.tools.call_schema`). A call's
  header (id, name) goes out once its `"arguments":` key is read, then the arguments value's text as it
  arrives: the concatenated fragments are the model's JSON text of the arguments.
- `auto`: text outside blocks of calls (`pdserve.api.call_formats`: `<tool_call>` blocks by default) is
  content (a possible start of a block's marker is held back); a block's calls to defined functions are
  sent whole (header and arguments) when the block closes; anything else stays content, as written.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.call_formats import call_format
from pdserve.api.tools import ToolPlan

_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\Z')


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolEvents:
    """What one piece of text produced: content text and `delta.tool_calls` entries (OpenAI's shape)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def header(self, index: int, name: str, arguments: str = "") -> None:
        self.calls.append({"index": index, "id": new_call_id(), "type": "function",
                           "function": {"name": name, "arguments": arguments}})

    def arguments(self, index: int, fragment: str) -> None:
        last = self.calls[-1] if self.calls else None
        if last is not None and last["index"] == index:  # one entry per call per piece
            last["function"]["arguments"] += fragment
        else:
            self.calls.append({"index": index, "function": {"arguments": fragment}})


class ToolCallStream:
    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.num_calls = 0
        self._depth = 0  # JSON nesting, outside strings (required)
        self._in_string = False
        self._escaped = False
        self._mode = "outside"  # required: outside | head | value | arguments | tail
        self._head = ""
        self._arguments_depth = 0
        self._pending = ""  # auto: held-back text (a tag's possible start, a block, leading whitespace)
        self._in_block = False
        self._opened = ""  # the marker that opened the block (given back with it when it holds no calls)
        self.format = call_format(plan.call_format)
        self._has_content = False

    def feed(self, text: str) -> ToolEvents:
        out = ToolEvents()
        if self.plan.mode == "required":
            for c in text:
                self._scan(c, out)
        else:
            self._pending += text
            self._auto(out, final=False)
        return out

    def finish(self, finish_reason: str | None) -> tuple[ToolEvents, str | None]:
        """What is left to send when the choice ends, and the choice's finish reason ("tool_calls" when it
        stopped after calling)."""
        out = ToolEvents()
        if self.plan.mode == "auto":
            self._auto(out, final=True)
        if self.num_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return out, finish_reason

    # required: a character-level scan of the constrained JSON
    def _scan(self, c: str, out: ToolEvents) -> None:
        depth = self._depth
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
        elif c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
        call_depth = 1 if self.plan.parallel else 0  # the depth a call object opens at
        if self._mode == "outside" and c == "{" and depth == call_depth and self._depth == depth + 1:
            self._mode, self._head = "head", c
        elif self._mode == "head":
            self._head += c
            if not self._in_string and (m := _HEAD.match(self._head)):
                out.header(self.num_calls, json.loads(m.group(1)))
                self._mode = "value"
        elif self._mode == "value" and not c.isspace():
            self._mode, self._arguments_depth = "arguments", depth
        if self._mode == "arguments":
            out.arguments(self.num_calls, c)
            if self._depth == self._arguments_depth and not self._in_string:
                self._mode = "tail"
                self.num_calls += 1
        elif self._mode == "tail" and self._depth == call_depth:
            self._mode = "outside"

    # auto: blocks of calls in free text, in the model family's format
    def _auto(self, out: ToolEvents, final: bool) -> None:
        fmt = self.format
        while self._pending:
            if self._in_block:
                end = self._pending.find(fmt.close) if fmt.close is not None else -1
                if end < 0 and not final:
                    return
                body = self._pending if end < 0 else self._pending[:end]
                rest = "" if end < 0 else self._pending[end + len(fmt.close):]
                self._in_block, self._pending = False, rest
                if not self._calls(body, out):
                    self._content(out, self._opened + body + ("" if end < 0 else fmt.close))
                continue
            if fmt.bare_json and not self._has_content and not self.num_calls and self._pending.lstrip()[:1] == "{":
                # the answer itself is the block: held to the end, then calls or content as written
                self._pending, self._in_block, self._opened = self._pending.lstrip(), True, ""
                continue
            start = self._pending.find(fmt.open)
            if start >= 0:
                self._content(out, self._pending[:start])
                self._pending, self._in_block = self._pending[start + len(fmt.open):], True
                self._opened = fmt.open
                continue
            keep = 0 if final else _partial_tag(self._pending, fmt.open)
            text = self._pending[: len(self._pending) - keep]
            if not final and text.strip() == "" and (self.num_calls or not self._has_content):
                return  # whitespace alone waits: it may only lead or separate calls
            self._content(out, text)
            self._pending = self._pending[len(text):]
            return

    def _content(self, out: ToolEvents, text: str) -> None:
        if not text.strip() and (self.num_calls or not self._has_content):
            return  # whitespace before, between or after calls is no answer
        out.content += text
        self._has_content = True

    def _calls(self, body: str, out: ToolEvents) -> bool:
        calls = self.format.parse(body, self.plan.names)
        if calls is None:
            return False
        for name, arguments in calls:
            out.header(self.num_calls, name, json.dumps(arguments, ensure_ascii=False))
            self.num_calls += 1
        return True


def _partial_tag(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse_message(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole choice's `message` (content and tool_calls) and finish reason."""
    stream = ToolCallStream(plan)
    first = stream.feed(text)
    last, finish_reason = stream.finish(finish_reason)
    calls: list[dict[str, Any]] = []
    for entry in first.calls + last.calls:
        if "id" in entry:
            calls.append({"id": entry["id"], "type": "function", "function": dict(entry["function"])})
        else:
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    content = first.content + last.content
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message, finish_reason
