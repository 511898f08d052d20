"""The router's gRPC API through Serve's gRPC proxy, next to its HTTP API on the same application.

One app per mode: router (API key configured) + prefill + decode over the redis transport, and a
colocated router + decode without keys; each is reached over gRPC (`application` metadata) and HTTP.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from pdserve.services.worker import WorkerConfig

pytest.importorskip("ray")
grpc = pytest.importorskip("grpc")
try:
    import httpx
except ImportError:  # the openai client here ships on httpx2
    import httpx2 as httpx

from pdserve.models.tiny import resolve_model_path
from pdserve.models.tokenizer import Tokenizer
from pdserve.services.decode.app import build_app as build_decode
from pdserve.services.prefill.app import build_app as build_prefill
from pdserve.services.router import RouterConfig, build_app
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1.client import GenerateClient, build_request

KEY = "sk-grpc-test"
APP, COLOCATED = "pdserve-grpc", "pdserve-grpc-colocated"
LONG_PROMPT = "The disaggregated prefill pool handles this long prompt: " * 2  # >= 32 tokens
SHORT_PROMPT = "Hi there"  # < 32 tokens: decode prefills locally
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(ray_serve, redis_server):
    workers = WorkerConfig(transport="redis", redis_url=redis_server.url, num_blocks=64, num_cpus=1)
    router = RouterConfig(api_keys=(KEY,), num_cpus=0.5)
    ray_serve.run(build_app(router, build_prefill(workers), build_decode(workers)), name=APP, route_prefix="/grpc")
    yield f"http://127.0.0.1:{ray_serve.http_port}/grpc"
    ray_serve.delete(APP)


@pytest.fixture(scope="module")
def colocated(ray_serve, server):
    decode = build_decode(WorkerConfig(num_blocks=64, num_cpus=0.5))
    router = RouterConfig(mode="colocated", num_cpus=0)
    ray_serve.run(build_app(router, None, decode), name=COLOCATED, route_prefix="/grpc-colocated")
    yield f"http://127.0.0.1:{ray_serve.http_port}/grpc-colocated"
    ray_serve.delete(COLOCATED)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(resolve_model_path("tiny"))


def _client(ray_serve, app=APP, key=KEY) -> GenerateClient:
    return GenerateClient(f"127.0.0.1:{ray_serve.grpc_port}", api_key=key, application=app)


def _generate(ray_serve, app=APP, key=KEY, request_id=None, **kwargs) -> list[pb.GenerateResponse]:
    async def run():
        async with _client(ray_serve, app, key) as client:
            return [chunk async for chunk in client.generate(request_id=request_id, timeout=60, **kwargs)]

    return asyncio.run(run())


def _rpc_error(ray_serve, app=APP, key=KEY, **kwargs) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        _generate(ray_serve, app, key, **kwargs)
    return info.value


def _http(base, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    resp = httpx.post(f"{base}{path}", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _by_choice(chunks):
    text, ids, finish = {}, {}, {}
    for c in chunks:
        if c.HasField("usage"):
            continue
        text[c.index] = text.get(c.index, "") + c.text
        ids.setdefault(c.index, []).extend(c.token_ids)
        if c.finish_reason:
            assert c.index not in finish, "a choice finished twice"
            finish[c.index] = c.finish_reason
    return text, ids, finish


@pytest.mark.parametrize("prompt", [LONG_PROMPT, SHORT_PROMPT])
def test_generate_matches_http_completions(ray_serve, server, tokenizer, prompt):
    http = _http(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "logprobs": 0, **GREEDY})
    chunks = _generate(ray_serve, model="tiny", text=prompt, include_usage=True, logprobs=True, **GREEDY)
    text, ids, finish = _by_choice(chunks)
    assert text[0] == http["choices"][0]["text"]
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in ids[0]]
    assert tokens == http["choices"][0]["logprobs"]["tokens"]
    assert finish == {0: "length"}
    logprobs = [lp.logprob for c in chunks for lp in c.logprobs]
    assert logprobs == pytest.approx(http["choices"][0]["logprobs"]["token_logprobs"], abs=1e-5)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert all(c.model == "tiny" for c in chunks)
    usage = chunks[-1]
    assert usage.HasField("usage") and not usage.token_ids and not usage.text
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens, usage.usage.total_tokens) == (
        http["usage"]["prompt_tokens"], 12, http["usage"]["prompt_tokens"] + 12)
    assert not any(c.HasField("usage") for c in chunks[:-1])


def test_generate_from_token_ids_and_chat(ray_serve, server, tokenizer):
    ids = tokenizer.encode(SHORT_PROMPT)
    http = _http(server, "/v1/completions", {"model": "tiny", "prompt": ids, **GREEDY})
    text, _, _ = _by_choice(_generate(ray_serve, model="tiny", token_ids=ids, **GREEDY))
    assert text[0] == http["choices"][0]["text"]

    messages = [{"role": "user", "content": "Tell me everything about disaggregated serving."}]
    http = _http(server, "/v1/chat/completions", {"model": "tiny", "messages": messages, **GREEDY})
    text, _, finish = _by_choice(_generate(ray_serve, model="tiny", messages=messages, **GREEDY))
    assert text[0] == http["choices"][0]["message"]["content"] and finish == {0: "length"}


def test_n_choices_with_seed_match_http(ray_serve, server):
    params = {"max_tokens": 8, "n": 3, "seed": 7, "temperature": 1.0}
    http = _http(server, "/v1/completions", {"model": "tiny", "prompt": SHORT_PROMPT, **params})
    text, _, finish = _by_choice(_generate(ray_serve, model="tiny", text=SHORT_PROMPT, **params))
    assert [text[i] for i in range(3)] == [c["text"] for c in sorted(http["choices"], key=lambda c: c["index"])]
    assert set(finish) == {0, 1, 2}


def test_request_id_from_metadata(ray_serve, server):
    chunks = _generate(ray_serve, request_id="grpc-req-7", model="tiny", text="x", max_tokens=2)
    assert {c.id for c in chunks} == {"cmpl-grpc-req-7"}
    chat = _generate(ray_serve, model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    assert chat[0].id.startswith("chatcmpl-") and len(chat[0].id) > len("chatcmpl-") + 16


def test_models(ray_serve, server):
    async def run(key):
        async with _client(ray_serve, key=key) as client:
            return await client.models(timeout=30)

    models = asyncio.run(run(KEY))
    assert [m.id for m in models] == ["tiny"] and models[0].owned_by == "pdserve" and models[0].max_model_len > 0
    for key in (None, "sk-wrong"):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            asyncio.run(run(key))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


STEPS = {"type": "object", "properties": {"steps": {"type": "array", "items": {"enum": ["alpha", "beta"]},
                                                  "minItems": 2, "maxItems": 4}, "done": {"type": "boolean"}},
         "required": ["steps", "done"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"type": "integer",
                                                                                        "minimum": 1}},
           "required": ["city", "days"], "additionalProperties": False}


def test_response_format_matches_http(ray_serve, server):
    """json_schema over gRPC: the same seeded, sampled, constrained text as the HTTP API gives, and it validates."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    params = {"max_tokens": 96, "temperature": 1.0, "seed": 11, "n": 2}
    http = _http(server, "/v1/completions", {"model": "tiny", "prompt": LONG_PROMPT, **params, "response_format": {
        "type": "json_schema", "json_schema": {"name": "steps", "schema": STEPS}}})
    text, _, finish = _by_choice(_generate(ray_serve, model="tiny", text=LONG_PROMPT, **params, response_format={
        "type": "json_schema", "json_schema": json.dumps(STEPS), "name": "steps"}))
    assert [text[i] for i in range(2)] == [c["text"] for c in sorted(http["choices"], key=lambda c: c["index"])]
    assert finish == {0: "stop", 1: "stop"}
    for i in range(2):
        jsonschema.validate(json.loads(text[i]), STEPS)


def test_named_tool_call_streams_as_tool_call_deltas(ray_serve, server):
    """tool_choice_function over gRPC: the calls arrive as ToolCallDelta entries (id and name once, then argument
    fragments) whose arguments validate against the function's parameters; the choice ends with "tool_calls";
    the call and its result go back as history."""
    import json

    jsonschema = pytest.importorskip("jsonschema")
    tools = [{"name": "weather", "description": "the forecast", "parameters": json.dumps(WEATHER)}]
    messages = [{"role": "user", "content": "Will it rain in Oslo?"}]
    chunks = _generate(ray_serve, model="tiny", messages=messages, tools=tools, tool_choice_function="weather",
                       max_tokens=96, temperature=1.0, seed=3)
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas and deltas[0].name == "weather" and deltas[0].id.startswith("call_")
    assert not "".join(c.text for c in chunks)
    arguments = "".join(d.arguments for d in deltas)
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert _by_choice(chunks)[2] == {0: "tool_calls"}
    history = [*messages, {"role": "assistant", "tool_calls": [{"id": deltas[0].id, "name": "weather",
                                                                "arguments": arguments}]},
               {"role": "tool", "content": "rain", "tool_call_id": deltas[0].id}]
    _, _, finish = _by_choice(_generate(ray_serve, model="tiny", messages=history, tools=tools, tool_choice="none",
                                        max_tokens=4))
    assert finish == {0: "length"}


@pytest.mark.parametrize("kwargs, field", [
    ({"response_format": {"type": "json_schema", "json_schema": '{"type": "string", "format": "nope"}'}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": "{not json"}}, "response_format.json_schema"),
    ({"tools": [{"name": "weather", "parameters": "{}"}], "tool_choice_function": "nowhere"}, "tool_choice"),
])
def test_structured_fields_the_server_cannot_serve_are_invalid_argument(ray_serve, server, kwargs, field):
    err = _rpc_error(ray_serve, model="tiny", messages=[{"role": "user", "content": "x"}], **kwargs)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details()
    assert _all_blocks_free(ray_serve)


@pytest.mark.parametrize("kwargs,code", [
    ({"model": "gpt-9", "text": "x"}, grpc.StatusCode.NOT_FOUND),
    ({"model": "tiny", "text": "x", "max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"model": "tiny", "text": ""}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"model": "tiny", "text": "x", "temperature": 3.0}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"model": "tiny", "token_ids": [1, 2, 100000]}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"model": "tiny", "text": "abc", "max_tokens": 2048}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"model": "tiny", "text": "x", "top_logprobs": 2}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, grpc.StatusCode.INVALID_ARGUMENT),
])
def test_invalid_requests(ray_serve, server, kwargs, code):
    err = _rpc_error(ray_serve, **kwargs)
    assert err.code() == code and err.details()


def test_missing_prompt_is_invalid(ray_serve, server):
    async def run():
        async with _client(ray_serve) as client:
            return [c async for c in client.stream(pb.GenerateRequest(model="tiny"), timeout=30)]

    with pytest.raises(grpc.aio.AioRpcError) as info:
        asyncio.run(run())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in info.value.details()


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_api_key_required(ray_serve, server, key):
    err = _rpc_error(ray_serve, key=key, model="tiny", text="x")
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in err.details()


def _all_blocks_free(ray_serve):
    for name in ("prefill", "decode"):
        stats = ray_serve.get_deployment_handle(name, app_name=APP).stats.remote().result()
        if stats["num_free_blocks"] != stats["num_total_blocks"] or stats["num_leased_blocks"]:
            return False
    return True


@pytest.mark.parametrize("prompt", [LONG_PROMPT, SHORT_PROMPT])
def test_cancel_mid_stream_frees_kv(ray_serve, server, prompt):
    async def run():
        async with _client(ray_serve) as client:
            call = client.stream(build_request("tiny", prompt, max_tokens=900, ignore_eos=True), timeout=60)
            received = 0
            async for _ in call:
                received += 1
                if received == 3:
                    break
            held = await asyncio.to_thread(_all_blocks_free, ray_serve)
            call.cancel()
            return held

    assert asyncio.run(run()) is False  # the request was running and held KV when cancelled
    # an abort frees KV within moments; running the 900 tokens to the end takes ~10 s on CPU
    deadline = time.monotonic() + 5
    while not _all_blocks_free(ray_serve):
        assert time.monotonic() < deadline, "KV blocks still allocated after the gRPC call was cancelled"
        time.sleep(0.1)


def test_colocated_mode_matches_http(ray_serve, colocated):
    http = _http(colocated, "/v1/completions", {"model": "tiny", "prompt": LONG_PROMPT, **GREEDY}, key=None)
    text, ids, finish = _by_choice(_generate(ray_serve, app=COLOCATED, key=None, model="tiny", text=LONG_PROMPT,
                                             **GREEDY))
    assert text[0] == http["choices"][0]["text"] and len(ids[0]) == 12 and finish == {0: "length"}
    messages = [{"role": "user", "content": "hi"}]
    chat = _generate(ray_serve, app=COLOCATED, key=None, model="tiny", messages=messages, **GREEDY)
    assert _by_choice(chat)[2] == {0: "length"}
