"""tool_choice auto in each model family's call format (pdserve.api.call_formats), chosen from the chat
template: Hermes/Qwen `<tool_call>` blocks, Mistral `[TOOL_CALLS]` lists and Llama 3.1 JSON (bare or after
`<|python_tag|>`, `parameters` for arguments, `;` between calls), each fed whole and in small pieces."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pdserve.api.call_formats import FORMATS, call_format, detect
from pdserve.api.tool_parser import ToolCallStream
from pdserve.api.tool_prompt import call_format_of
from pdserve.api.tools import ToolPlan

AUTO = ToolPlan("auto", ("get_weather", "ping"), True)
WEATHER = {"city": "Paris", "days": [1, {"n": 2}]}
# minimal templates in each family's style: each reads `tools` and names the family's call marker
TEMPLATES = {
    "mistral": "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}{% if tools %}[AVAILABLE_TOOLS]"
               "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{# calls: [TOOL_CALLS] #}",
    "hermes": "{% if tools %}<tools>{{ tools | tojson }}</tools> answer with <tool_call> blocks{% endif %}"
              "{% for m in messages %}{{ m.content }}{% endfor %}",
    "llama3_json": "{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}"
                   "{% if m.role == 'ipython' %}<|python_tag|>{% endif %}<|eot_id|>{% endfor %}",
}


def _pieces(text: str):
    yield [text]
    yield [text[i : i + 3] for i in range(0, len(text), 3)]


def _feed(plan: ToolPlan, pieces: list[str]):
    stream, content, calls = ToolCallStream(plan), "", []
    for piece in pieces:
        out = stream.feed(piece)
        content += out.content
        calls += out.calls
    last, finish = stream.finish("stop")
    return content + last.content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                    for c in calls + last.calls], finish


def _plan(name: str) -> ToolPlan:
    return dataclasses.replace(AUTO, call_format=name)


CASES = [
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + '}, '
                '{"name": "ping", "arguments": {}}]', "Sure. ", [("get_weather", WEATHER), ("ping", {})]),
    ("llama3_json", '  {"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + '}; {"name": "ping", '
                    '"parameters": {}}', "", [("get_weather", WEATHER), ("ping", {})]),
    ("llama3_json", '<|python_tag|>{"name": "ping", "parameters": {}}', "", [("ping", {})]),
    ("llama3_json", 'Let me check. <|python_tag|>{"name": "ping", "parameters": {}}', "Let me check. ", [("ping", {})]),
    ("hermes", 'ok <tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', "ok ", [("ping", {})]),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_each_family_format_is_read_in_any_split(name, text, content, calls):
    for pieces in _pieces(text):
        assert _feed(_plan(name), pieces) == (content, calls, "tool_calls")


@pytest.mark.parametrize("name, text", [
    ("mistral", '[TOOL_CALLS][{"name": "unknown", "arguments": {}}]'),  # not a defined function
    ("mistral", '[TOOL_CALLS]{"name": "ping", "arguments": {}}'),  # not a list
    ("llama3_json", '{"answer": 42}'),  # a JSON answer, not a call
    ("llama3_json", '{"name": "ping", "arguments": {}}'),  # the wrong arguments key for this family
    ("hermes", '[TOOL_CALLS][{"name": "ping", "arguments": {}}]'),  # another family's marker
])
def test_what_is_not_a_call_in_the_format_stays_content_as_written(name, text):
    for pieces in _pieces(text):
        assert _feed(_plan(name), pieces) == (text, [], "stop")


def test_plain_text_streams_without_waiting_for_the_end():
    stream = ToolCallStream(_plan("llama3_json"))
    assert stream.feed("The weather is fine").content == "The weather is fine"
    stream = ToolCallStream(_plan("mistral"))
    assert stream.feed("Fine [TOOL").content == "Fine "  # a possible marker start is held back


def test_the_format_follows_the_template():
    assert {name: call_format_of(t) for name, t in TEMPLATES.items()} == {n: n for n in TEMPLATES}
    # a template that does not render tools gets pdserve's own section, which teaches <tool_call> blocks
    assert call_format_of("{% for m in messages %}[TOOL_CALLS]{{ m.content }}{% endfor %}") == "hermes"
    assert call_format_of(None) == "hermes" and detect("{{ tools }}", True) == "hermes"
    assert set(FORMATS) == {"hermes", "mistral", "llama3_json"}
    with pytest.raises(ValueError, match="unknown tool call format"):
        call_format("nope")
