"""Chat messages on the wire: text content (parts joined), and the tool calls and results of a tool-using
conversation; `for_template` is what a chat template reads of a plain message."""

from __future__ import annotations

from typing import Literal

from pdserve.api.tools import MAX_TOOLS, ToolCall
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class TextPart(BaseModel):
    """One part of a message's content; only text reaches a text-only model."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    # None only for an assistant message that calls tools
    content: str | list[TextPart] | None = Field(None, union_mode="left_to_right")
    name: str | None = Field(None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)  # assistant: the calls it made
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)  # tool: the call this answers

    @field_validator("content", mode="before")
    @classmethod
    def _check_parts(cls, value):
        if isinstance(value, list):
            for k, part in enumerate(value):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind != "text":
                    raise ValueError(f"content[{k}] has type {kind!r}: only text parts are supported by this model")
        return value

    @model_validator(mode="after")
    def _check_role_fields(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id (the call it answers), and only it has one")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        return self

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, str]:
        message = {"role": self.role, "content": self.text}
        if self.name is not None:
            message["name"] = self.name
        return message
