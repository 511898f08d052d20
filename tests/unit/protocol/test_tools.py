"""Tool calling's request side: validation of tools, tool_choice and history (400s naming the field), the
constrained output schema, and the prompt rendering (the default format, and a template's own)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pdserve.api import tool_prompt
from pdserve.api.protocol import ChatCompletionRequest
from pdserve.api.tools import MAX_PARALLEL_CALLS, NO_PARAMETERS
from pdserve.services.router.errors import from_validation_error
from pydantic import ValidationError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}


def _request(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": ASK, **body})


def _error(**body):
    with pytest.raises(ValidationError) as info:
        _request(**body)
    return from_validation_error(info.value)


@pytest.mark.parametrize("body,param,words", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "get_weather is defined twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters", "type \"object\""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]},
     "tools.0.function.parameters", "uniqueItems"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "pattern"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "function"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice", "must be"),
    ({"tool_choice": {"type": "function", "function": {}}, "tools": TOOLS}, "tool_choice", "must be"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice", "exclude each other"),
    ({"messages": [*ASK, RESULT]}, "messages", "no earlier assistant message"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1", "tool_call_id"),
    ({"messages": [*ASK, {"role": "user", "content": None}]}, "messages.1", "content is required"),
    ({"messages": [*ASK, {**CALL, "role": "user"}]}, "messages.1", "only assistant"),
    ({"messages": [*ASK, {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": "[1]"}}]}]}, "messages.1.tool_calls.0.function.arguments", "object"),
    ({"parallel_tool_calls": 1, "tools": TOOLS}, "parallel_tool_calls", ""),
])
def test_bad_tool_fields_are_400s_naming_the_field(body, param, words):
    err = _error(**body)
    assert err.status == 400 and err.param == param and words in err.message


def test_defaults_and_none():
    assert _request(tools=TOOLS).tool_plan.mode == "auto"
    assert _request(tools=TOOLS).to_sampling_params(16).json_schema is None  # auto is not constrained
    assert _request().tool_plan is None and _request(tools=TOOLS, tool_choice="none").tool_plan is None
    assert _request(tools=[], tool_choice="none").tool_plan is None
    # a JSON response_format is fine when no call can be made
    assert _request(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"}).tool_plan is None


def _valid(schema: dict, value) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def test_required_schema_is_a_list_of_calls_to_defined_functions():
    req = _request(tools=TOOLS, tool_choice="required")
    plan = req.tool_plan
    assert plan.mode == "required" and plan.names == ("get_weather", "ping") and plan.parallel
    schema = json.loads(req.to_sampling_params(16).json_schema)
    assert schema == json.loads(plan.schema)
    weather = {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert _valid(schema, [weather, {"name": "ping", "arguments": {}}])
    assert not _valid(schema, [])  # at least one call
    assert not _valid(schema, [weather] * (MAX_PARALLEL_CALLS + 1))
    assert not _valid(schema, [{"name": "get_weather", "arguments": {}}])  # city is required
    assert not _valid(schema, [{"name": "ping", "arguments": {"x": 1}}])  # no parameters: no arguments
    assert not _valid(schema, [{"name": "other", "arguments": {}}])


def test_named_choice_without_parallel_is_one_call_to_that_function():
    req = _request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   parallel_tool_calls=False)
    schema = json.loads(req.to_sampling_params(16).json_schema)
    assert req.tool_plan.names == ("get_weather",)
    assert list(schema["properties"]) == ["name", "arguments"]  # name first: the stream reads it first
    assert _valid(schema, {"name": "get_weather", "arguments": {"city": "x"}})
    assert not _valid(schema, {"name": "ping", "arguments": {}})
    assert not _valid(schema, [{"name": "get_weather", "arguments": {"city": "x"}}])
    assert json.loads(_request(tools=TOOLS[1:], tool_choice="required", parallel_tool_calls=False).tool_plan
                      .schema)["properties"]["arguments"] == NO_PARAMETERS


class ChatMLTokenizer:
    chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_default_rendering_adds_a_system_section_and_renders_history():
    req = _request(messages=[*ASK, CALL, RESULT], tools=TOOLS, tool_choice="required")
    messages, extra = tool_prompt.render(req.messages, req.tools, req.tool_plan, ChatMLTokenizer.chat_template)
    assert extra == {} and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert "<tools>" in system and "You must call at least one function." in system
    for tool in TOOLS:  # each definition, as JSON
        assert json.dumps(tool, separators=(",", ":")) in system
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert messages[3]["content"] == "<tool_response>\n21 C\n</tool_response>"


def test_default_rendering_joins_a_given_system_message_and_hides_tools_for_none():
    base = [{"role": "system", "content": "Be brief."}, *ASK]
    req = _request(messages=base, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}})
    messages, _ = tool_prompt.render(req.messages, req.tools, req.tool_plan, None)
    assert len(messages) == 2 and messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert messages[0]["content"].endswith("You must call the function ping.")
    req = _request(messages=base, tools=TOOLS, tool_choice="none")
    messages, _ = tool_prompt.render(req.messages, req.tools, req.tool_plan, None)
    assert messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


def test_a_template_that_reads_tools_renders_them_itself():
    template = ("{% if tools %}TOOLS={{ tools | length }};{% endif %}{% for m in messages %}{{ m['role'] }}"
                "{% if m.tool_calls %}:{{ m.tool_calls[0].function.arguments.city }}{% endif %}"
                "{% if m.tool_call_id %}@{{ m.tool_call_id }}{% endif %};{% endfor %}")
    assert tool_prompt.template_reads_tools(template) and not tool_prompt.template_reads_tools(
        ChatMLTokenizer.chat_template)
    req = _request(messages=[*ASK, CALL, RESULT], tools=TOOLS)
    messages, extra = tool_prompt.render(req.messages, req.tools, req.tool_plan, template)
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # a mapping, as HF's
    from pdserve.models.tokenizer import Tokenizer

    tok = Tokenizer.__new__(Tokenizer)
    tok.chat_template, tok._compiled_template, tok.bos_token, tok.eos_token = template, None, "", ""
    assert tok.apply_chat_template(messages, **extra) == "TOOLS=2;user;assistant:Paris;tool@call_1;"
