"""The router's gRPC layer without Ray: proto to HTTP body, events to chunks, errors to status codes."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

from pdserve.api.contract import TokenBatch

import grpc
import pytest
from pdserve.services.router import openai_api as oa
from pdserve.services.router.admission import Admission
from pdserve.services.router.errors import APIError
from pdserve.services.router.grpc_api import GrpcServiceMixin, grpc_status, request_body, response_chunk
from pdserve.observability.metrics import ServingMetrics
from pdserve.services.router.metrics import APIMetrics
from pdserve.observability.tracing import Tracing
from pdserve.v1 import generate_pb2 as pb
from pdserve.v1.client import build_request


def test_status_mapping():
    expected = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 413: "RESOURCE_EXHAUSTED",
                429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE", 500: "INTERNAL", 418: "INTERNAL"}
    assert {status: grpc_status(status).name for status in expected} == expected


def test_completion_body_carries_only_what_was_set():
    body, chat = request_body(build_request("tiny", "hi", max_tokens=0, temperature=0.0, seed=0, stop=["x"],
                                            stop_token_ids=[2], include_usage=True))
    assert not chat
    assert body["prompt"] == "hi" and body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["seed"]) == (0, 0.0, 0)
    assert body["stop"] == ["x"] and body["stop_token_ids"] == [2]
    assert "top_p" not in body and "n" not in body and "repetition_penalty" not in body and "logprobs" not in body
    assert body["model"] == "tiny" and "model" not in request_body(build_request("", "hi"))[0]  # "": unset


def test_logprobs_follow_each_api():
    body, _ = request_body(build_request("tiny", token_ids=[1, 2], logprobs=True, top_logprobs=3))
    assert body["prompt"] == [1, 2] and body["logprobs"] == 3
    body, chat = request_body(build_request("tiny", messages=[{"role": "user", "content": "x", "name": "a"}],
                                            logprobs=True, top_logprobs=3))
    assert chat and body["messages"] == [{"role": "user", "content": "x", "name": "a"}]
    assert body["logprobs"] is True and body["top_logprobs"] == 3
    with pytest.raises(APIError) as info:
        request_body(build_request("tiny", "x", top_logprobs=3))
    assert info.value.status == 400 and info.value.param == "top_logprobs"


def test_a_prompt_is_required():
    with pytest.raises(APIError) as info:
        request_body(pb.GenerateRequest(model="tiny"))
    assert info.value.status == 400 and info.value.param == "prompt"
    assert request_body(build_request("tiny", token_ids=[]))[0]["prompt"] == []


def test_response_chunk():
    meta = oa.ResponseMeta("cmpl-1", "tiny", False)
    event = TokenBatch((5, 6), "ab", finished=True, finish_reason="length", logprobs=(-0.5, -0.25),
                       top_logprobs=(((5, -0.5),), ((6, -0.25), (7, -3.0))))
    chunk = response_chunk(meta, 1, event, want_logprobs=True)
    assert (chunk.id, chunk.model, chunk.index, chunk.text) == ("cmpl-1", "tiny", 1, "ab")
    assert list(chunk.token_ids) == [5, 6]
    assert chunk.finish_reason == "length" and not chunk.HasField("usage")
    assert [lp.logprob for lp in chunk.logprobs] == [-0.5, -0.25]
    assert [(t.token_id, t.logprob) for t in chunk.logprobs[1].top] == [(6, -0.25), (7, -3.0)]
    assert not response_chunk(meta, 0, dataclasses.replace(event, finished=False), want_logprobs=False).logprobs
    assert response_chunk(meta, 0, dataclasses.replace(event, finished=False), want_logprobs=False).finish_reason == ""


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_structured_fields_become_the_http_body_and_validate_as_it():
    """response_format, tools, tool_choice and the history's tool calls map onto the HTTP API's fields, and the
    body they make passes the HTTP API's own validation (which then names the same fields)."""
    import json

    from pdserve.api.protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [{"id": "call_1", "name": "weather", "arguments": '{"city": "Oslo"}'}]},
                {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]
    body, chat = request_body(build_request(
        "tiny", messages=messages, tools=[{"name": "weather", "description": "now", "parameters": json.dumps(WEATHER)}],
        tool_choice_function="weather", parallel_tool_calls=False))
    assert chat and body["tools"] == [{"type": "function", "function": {"name": "weather", "description": "now",
                                                                        "parameters": WEATHER}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert body["parallel_tool_calls"] is False
    assert body["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]}
    assert body["messages"][2] == {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}
    ChatCompletionRequest.model_validate(body)
    body, _ = request_body(build_request("tiny", "x", response_format={
        "type": "json_schema", "json_schema": json.dumps(WEATHER), "name": "w", "strict": True}))
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER,
                                                                              "strict": True}}
    body, _ = request_body(build_request("tiny", "x", response_format={"type": "json_object"}))
    assert body["response_format"] == {"type": "json_object"} and "tools" not in body and "tool_choice" not in body
    assert "response_format" not in request_body(build_request("tiny", "x"))[0]


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": "{not json"}}, "response_format.json_schema"),
    ({"tools": [{"name": "f", "parameters": "[1,"}]}, "tools[0].parameters"),
    ({"tools": [{"name": "f"}], "tool_choice": "auto", "tool_choice_function": "f"}, "tool_choice"),
])
def test_structured_fields_that_are_not_json_or_contradict_are_400(fields, param):
    with pytest.raises(APIError) as info:
        request_body(build_request("tiny", messages=[{"role": "user", "content": "x"}], **fields))
    assert info.value.status == 400 and info.value.param == param


def test_response_chunk_splits_tool_calls_from_text():
    """Chat with tools (required): the constrained call text becomes ToolCallDelta entries (the header once, then
    argument fragments) and the choice finishes with "tool_calls"."""
    from pdserve.api.tool_parser import ToolCallStream
    from pdserve.api.tools import ToolPlan

    meta = oa.ResponseMeta("chatcmpl-1", "tiny", True)
    stream = ToolCallStream(ToolPlan("required", ("weather",), False))
    pieces = ['{"name": "weather", "arguments": ', '{"city": ', '"Oslo"}}']
    chunks = [response_chunk(meta, 0, TokenBatch((1,), piece, finished=k == 2, finish_reason="stop" if k == 2 else None),
                             want_logprobs=False, tools=stream) for k, piece in enumerate(pieces)]
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].name == "weather" and deltas[0].id.startswith("call_") and {d.index for d in deltas} == {0}
    assert "".join(d.arguments for d in deltas) == '{"city": "Oslo"}'
    assert all(not d.name for d in deltas[1:]) and all(c.text == "" for c in chunks)
    assert [c.finish_reason for c in chunks] == ["", "", "tool_calls"]


class FakeContext:
    def __init__(self, metadata=()):
        self.metadata = list(metadata)
        self.code = self.details = None
        self.trailing_metadata = []

    def set_trailing_metadata(self, metadata):
        self.trailing_metadata = list(metadata)

    def invocation_metadata(self):
        return self.metadata

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details


class BodyAdmission(Admission):
    """The real key and size checks; the admitted request is the body as given (no tokenizer here)."""

    def __init__(self, config, keys):
        self.config, self.api_keys = config, keys

    def admit(self, data, chat, num_inflight):
        return SimpleNamespace(data=data, chat=chat, want_logprobs=False, include_usage=True,
                               prompt_token_ids=[1, 2, 3], tools=None, num_choices=1)


class FakeRouter(GrpcServiceMixin):
    def __init__(self, events, keys=()):
        self.num_inflight = 0
        self.config = SimpleNamespace(max_body_bytes=1 << 16, served_model_name="tiny", max_model_len=128,
                                      retry_after_s=1, stream_interval_s=0.0)
        self.created = 0
        self.metrics = ServingMetrics("router", "r0", "tiny")
        self.api_metrics = APIMetrics(self.metrics.registry)
        self.telemetry = SimpleNamespace(tracing=Tracing.disabled())
        self.started = []
        self.events = events
        self.admission = BodyAdmission(self.config, keys)

    async def _start(self, prepared, request_id, parent=None):
        self.started.append((prepared.data, prepared.chat, request_id))
        if isinstance(self.events, Exception):
            raise self.events
        return oa.ResponseMeta("cmpl-" + request_id, "tiny", prepared.chat), self.events


def _count_rejection(self, err, endpoint):
    self.metrics.count_rejection(err.reason)
    self.api_metrics.requests.labels(endpoint, str(err.status)).inc()


FakeRouter._count_rejection = _count_rejection


class Events:
    def __init__(self, items, fail=None):
        self.items, self.fail, self.closed = list(items), fail, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.fail:
            raise self.fail
        raise StopAsyncIteration

    async def aclose(self):
        self.closed = True


async def _collect(gen):
    return [chunk async for chunk in gen]


@pytest.mark.parametrize("interval_s", [None, 0.0])
def test_generate_streams_then_usage_and_closes(interval_s):
    """Coalescing off: a message per event. On: events that arrive together go out as one message."""
    events = Events([(0, TokenBatch((4,), "a")), (0, TokenBatch((5,), "b", finished=True, finish_reason="length"))])
    router = FakeRouter(events)
    router.config.stream_interval_s = interval_s
    context = FakeContext([("x-request-id", "r-1")])
    chunks = asyncio.run(_collect(router.Generate(build_request("tiny", "hi"), grpc_context=context)))
    texts = ["a", "b", ""] if interval_s is None else ["ab", ""]
    assert [c.text for c in chunks] == texts and chunks[-2].finish_reason == "length"
    assert [t for c in chunks for t in c.token_ids] == [4, 5]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 2)
    assert {c.id for c in chunks} == {"cmpl-r-1"} and events.closed and context.code is None
    assert context.trailing_metadata == [("x-request-id", "r-1")]


def test_rejections_set_the_status_before_raising():
    router = FakeRouter(Events([]), keys=("sk-1",))
    for metadata in ([], [("authorization", "Bearer nope")]):
        context = FakeContext(metadata)
        with pytest.raises(RuntimeError):
            asyncio.run(_collect(router.Generate(build_request("tiny", "hi"), grpc_context=context)))
        assert context.code == grpc.StatusCode.UNAUTHENTICATED and "API key" in context.details
        assert context.details.endswith(f"(request id {context.trailing_metadata[0][1]})")
    assert not router.started
    context = FakeContext([("authorization", "Bearer sk-1")])
    asyncio.run(_collect(router.Generate(build_request("tiny", "hi"), grpc_context=context)))
    assert router.started and len(router.started[0][2]) == 32  # a fresh id without x-request-id


def test_an_unexpected_admission_failure_is_internal_with_a_clean_message():
    context = FakeContext([("x-request-id", "r-9")])
    with pytest.raises(RuntimeError) as info:
        asyncio.run(_collect(FakeRouter(ValueError("SLOs must be positive")).Generate(
            build_request("tiny", "hi"), grpc_context=context)))
    assert context.code == grpc.StatusCode.INTERNAL
    assert context.details == str(info.value) == "generation failed (request id r-9)"


def test_failure_mid_stream_is_internal_and_closes():
    events = Events([(0, TokenBatch((4,), "a"))], fail=ValueError("boom"))
    context = FakeContext()
    chunks = []

    async def run():
        async for chunk in FakeRouter(events).Generate(build_request("tiny", "hi"), grpc_context=context):
            chunks.append(chunk)

    with pytest.raises(RuntimeError):
        asyncio.run(run())
    assert [c.text for c in chunks] == ["a"] and events.closed
    assert context.code == grpc.StatusCode.INTERNAL
    assert context.details == f"generation failed (request id {context.trailing_metadata[0][1]})"


def test_models_and_its_auth():
    router = FakeRouter(Events([]), keys=("sk-1",))
    keyed = FakeContext([("authorization", "Bearer sk-1")])
    listing = asyncio.run(router.Models(pb.ModelsRequest(), grpc_context=keyed))
    assert [(m.id, m.max_model_len, m.owned_by) for m in listing.models] == [("tiny", 128, "pdserve")]
    context = FakeContext()
    with pytest.raises(RuntimeError):
        asyncio.run(router.Models(pb.ModelsRequest(), grpc_context=context))
    assert context.code == grpc.StatusCode.UNAUTHENTICATED
