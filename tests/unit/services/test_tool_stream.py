"""Tool calls out of generated text: whole responses and SSE streams, fed in any split, and the chunks' shapes
checked by what the official openai client does with them (its stream-state accumulator)."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from pdserve.api.contract import Priority, TokenBatch
from pdserve.api.tool_parser import ToolCallStream, parse_message
from pdserve.api.tools import ToolPlan
from pdserve.sampling_params import SamplingParams
from pdserve.services.router import openai_api as oa
from pdserve.services.router.admission import Prepared
from pdserve.services.router.streaming import sse_stream

REQUIRED = ToolPlan("required", ("get_weather", "ping"), True)
SINGLE = ToolPlan("required", ("get_weather",), False)
AUTO = ToolPlan("auto", ("get_weather", "ping"), True)
ARGS = '{"city": "Pa}r\\"is", "days": [1, {"n": 2}]}'
PARALLEL = f'[{{"name": "get_weather", "arguments": {ARGS}}}, {{"name":"ping","arguments":{{}}}}]'
BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _splits(text: str):
    yield [text]
    yield list(text)
    yield [text[i : i + 5] for i in range(0, len(text), 5)]


def _feed(plan: ToolPlan, pieces: list[str], finish="stop"):
    stream, content, calls = ToolCallStream(plan), "", []
    for piece in pieces:
        out = stream.feed(piece)
        content += out.content
        calls += out.calls
    last, finish = stream.finish(finish)
    return content + last.content, calls + last.calls, finish


@pytest.mark.parametrize("pieces", list(_splits(PARALLEL)))
def test_required_calls_are_read_in_any_split(pieces):
    content, calls, finish = _feed(REQUIRED, pieces)
    assert content == "" and finish == "tool_calls"
    headers = [c for c in calls if "id" in c]
    assert [(h["index"], h["function"]["name"]) for h in headers] == [(0, "get_weather"), (1, "ping")]
    args = {0: "", 1: ""}
    for c in calls:
        args[c["index"]] += c["function"]["arguments"]
    assert args == {0: ARGS, 1: "{}"}  # the model's own text of each arguments value


def test_whole_messages():
    message, finish = parse_message(SINGLE, '{"name": "get_weather", "arguments": {"city": "Paris"}}', "stop")
    assert finish == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) == 29 and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    message, finish = parse_message(REQUIRED, '[{"name": "ping", "arguments": {', "length")  # cut short
    assert finish == "length" and message["tool_calls"][0]["function"] == {"name": "ping", "arguments": "{"}
    message, finish = parse_message(AUTO, "It is sunny.", "stop")
    assert message == {"role": "assistant", "content": "It is sunny."} and finish == "stop"


@pytest.mark.parametrize("text,content,names", [
    (f"Let me check.\n{BLOCK}", "Let me check.\n", ["get_weather"]),
    (f"{BLOCK}\n{BLOCK}\n", "", ["get_weather", "get_weather"]),
    (f"\n {BLOCK}", "", ["get_weather"]),  # whitespace alone is no content
    (" \n", "", []),
    ("\nHi", "\nHi", []),
    (BLOCK.removesuffix("</tool_call>"), "", ["get_weather"]),  # EOS before the closing tag
    ("a < b and <tool c", "a < b and <tool c", []),
    ('<tool_call>{"name": "other", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "other", "arguments": {}}</tool_call>', []),  # not a defined function: text
    ('<tool_call>{"name": "ping", "arguments": [1]}</tool_call> ok',
     '<tool_call>{"name": "ping", "arguments": [1]}</tool_call> ok', []),
])
def test_auto_reads_tool_call_blocks_in_any_split(text, content, names):
    for pieces in _splits(text):
        got, calls, finish = _feed(AUTO, pieces)
        assert got == content and [c["function"]["name"] for c in calls] == names
        assert finish == ("tool_calls" if names else "stop")
        for call in calls:  # whole: header and arguments in one entry
            assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_auto_holds_back_only_a_possible_tag():
    stream = ToolCallStream(AUTO)
    assert stream.feed("Hi <to").content == "Hi "
    assert stream.feed("day").content == "<today"
    assert stream.feed("<tool_call>{").content == ""


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


async def _sse(plan: ToolPlan, texts: list[str], n: int = 1) -> list[dict]:
    async def events():
        for k, text in enumerate(texts):
            for index in range(n):
                last = k == len(texts) - 1
                yield index, TokenBatch(tuple(map(ord, text)), text, last, "stop" if last else None)

    p = Prepared(True, ((1, 2),), SamplingParams(max_tokens=64), n, True, False, False, 2.0, 0.2,
                 Priority.INTERACTIVE, tools=plan)
    meta = oa.ResponseMeta("chatcmpl-1", "m", True)
    body = b"".join([part async for part in sse_stream(meta, p, events(), ByteTokenizer(), None)])
    lines = [line.removeprefix(b"data: ") for line in body.split(b"\n\n") if line]
    assert lines[-1] == b"[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("plan,text", [(REQUIRED, PARALLEL), (AUTO, f"Checking. {BLOCK}")])
def test_streamed_chunks_assemble_in_the_openai_client(plan, text):
    chunks = asyncio.run(_sse(plan, [text[i : i + 3] for i in range(0, len(text), 3)], n=2))
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion()
    whole, _ = parse_message(plan, text, "stop")
    for choice in final.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == whole["content"]
        assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant"
    headers = [c for chunk in chunks for ch in chunk["choices"] for c in ch["delta"].get("tool_calls", ())
               if "id" in c]
    assert all(h["type"] == "function" and h["id"].startswith("call_") for h in headers)
    assert len({h["id"] for h in headers}) == len(headers) == 2 * len(whole["tool_calls"])
    finishes = [ch["finish_reason"] for chunk in chunks for ch in chunk["choices"] if ch["finish_reason"]]
    assert finishes == ["tool_calls", "tool_calls"]


def test_required_stream_sends_arguments_in_fragments():
    chunks = asyncio.run(_sse(SINGLE, list('{"name": "get_weather", "arguments": {"city": "Paris"}}')))
    fragments = [c["function"]["arguments"] for chunk in chunks for ch in chunk["choices"]
                 for c in ch["delta"].get("tool_calls", ()) if "id" not in c]
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Paris"}'
    assert all("content" not in ch["delta"] or ch["delta"]["content"] is None
               for chunk in chunks for ch in chunk["choices"])
