"""The router's gRPC GenerateService (pdserve/v1/generate.proto), served by Ray Serve's gRPC proxy.

A GenerateRequest becomes the very body the HTTP API would parse (completions, or chat when it
carries messages) and goes through the same admission (`_start`); events become GenerateResponse
deltas. Errors end the RPC with a status code: the code is set on Serve's gRPC context and an
exception raised, which is how Serve carries a user status through the proxy.
"""

# No `from __future__ import annotations`: the methods are inspected by Serve on an ingress class
# whose other methods FastAPI reads; keep every annotation a real object.

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pdserve.services.router import openai_api as oa
from pdserve.services.router.errors import APIError, bad_request
from pdserve.api.contract import TokenBatch
from pdserve.api.tool_parser import ToolCallStream, ToolEvents
from pdserve.services.router.streaming import singles, by_choice, tool_events, upstream_error
from pdserve.streams import batches
from pdserve.v1 import generate_pb2 as pb

REQUEST_ID_KEY = "x-request-id"
SERVE_REQUEST_ID_KEY = "request_id"  # Serve's own request id metadata, honoured as a fallback

# 413 (request too large) maps to RESOURCE_EXHAUSTED: the code gRPC itself returns for a message
# over the server's receive limit, so "too large" reads the same whichever limit caught it.
_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def grpc_status(http_status: int) -> grpc.StatusCode:
    return _STATUS_CODES.get(http_status, grpc.StatusCode.INTERNAL)


def request_body(request: pb.GenerateRequest) -> tuple[dict[str, Any], bool]:
    """(the HTTP body, chat?) for a GenerateRequest; raises APIError(400) for what JSON cannot say."""
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise bad_request("one of text, token_ids or messages is required", param="prompt")
    chat = kind == "messages"
    body: dict[str, Any] = {"stream": True}
    if request.model:  # proto3 cannot tell "" from unset: either means the served model, as HTTP's absent one
        body["model"] = request.model
    if kind == "text":
        body["prompt"] = request.text
    elif kind == "token_ids":
        body["prompt"] = list(request.token_ids.ids)
    else:
        body["messages"] = [_message(m) for m in request.messages.messages]
    for name in ("max_tokens", "temperature", "top_p", "n", "seed", "repetition_penalty", "user"):
        if request.HasField(name):
            body[name] = getattr(request, name)
    # proto3 zero values equal the HTTP defaults for these
    for name in ("top_k", "min_p", "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens"):
        body[name] = getattr(request, name)
    if request.stop:
        body["stop"] = list(request.stop)
    if request.stop_token_ids:
        body["stop_token_ids"] = list(request.stop_token_ids)
    if chat:
        body["logprobs"] = request.logprobs
        if request.top_logprobs:
            body["top_logprobs"] = request.top_logprobs
    elif request.logprobs:
        body["logprobs"] = request.top_logprobs
    elif request.top_logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if request.include_usage:
        body["stream_options"] = {"include_usage": True}
    _structured_fields(request, body)
    return body, chat


def _json_field(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise bad_request(f"{param} is not valid JSON text: {exc}", param=param) from None


def _message(m: pb.ChatMessage) -> dict[str, Any]:
    message: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.HasField("name"):
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
        message["content"] = m.content or None  # proto3 cannot say null: a call-only message has no content
    if m.HasField("tool_call_id"):
        message["tool_call_id"] = m.tool_call_id
    return message


def _structured_fields(request: pb.GenerateRequest, body: dict[str, Any]) -> None:
    """response_format, tools, tool_choice and parallel_tool_calls, as the HTTP body states them (the HTTP
    API's validation then applies, and names the same fields)."""
    if request.HasField("response_format"):
        fmt = request.response_format
        body["response_format"] = {"type": fmt.type}
        if fmt.json_schema:
            schema = _json_field(fmt.json_schema, "response_format.json_schema")
            body["response_format"]["json_schema"] = {
                "name": fmt.name or "response", "schema": schema, **({"strict": fmt.strict} if fmt.HasField("strict") else {})}
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": f.name, **({"description": f.description} if f.description else {}),
            **({"parameters": _json_field(f.parameters, f"tools[{k}].parameters")} if f.parameters else {}),
            **({"strict": f.strict} if f.HasField("strict") else {})}} for k, f in enumerate(request.tools)]
    if request.tool_choice and request.tool_choice_function:
        raise bad_request("set tool_choice or tool_choice_function, not both", param="tool_choice")
    if request.tool_choice:
        body["tool_choice"] = request.tool_choice
    elif request.tool_choice_function:
        body["tool_choice"] = {"type": "function", "function": {"name": request.tool_choice_function}}
    if request.HasField("parallel_tool_calls"):
        body["parallel_tool_calls"] = request.parallel_tool_calls


def response_chunk(
    meta: oa.ResponseMeta, index: int, event: TokenBatch, want_logprobs: bool,
    tools: ToolCallStream | None = None,
) -> pb.GenerateResponse:
    """`tools`: the choice's tool-call parser (chat with tools): the text splits into content and calls."""
    token_ids = list(event.token_ids)
    chunk = pb.GenerateResponse(id=meta.id, model=meta.model, index=index, text=event.text, token_ids=token_ids)
    if event.finished:
        chunk.finish_reason = event.finish_reason or ""
    if tools is not None:
        calls, finish = tool_events(tools, event)
        chunk.text = calls.content
        chunk.tool_calls.extend(_call_deltas(calls))
        if event.finished:
            chunk.finish_reason = finish or ""
    logprobs = list(event.logprobs or ())
    if want_logprobs and token_ids and len(logprobs) == len(token_ids):
        top = list(event.top_logprobs or ())
        for k, lp in enumerate(logprobs):
            alternatives = top[k] if k < len(top) and top[k] else ()
            top_k = [pb.TopLogprob(token_id=i, logprob=p) for i, p in alternatives]
            chunk.logprobs.add(logprob=lp, top=top_k)
    return chunk


def _call_deltas(events: ToolEvents) -> list[pb.ToolCallDelta]:
    return [pb.ToolCallDelta(index=c["index"], id=c.get("id", ""), name=c["function"].get("name", ""),
                             arguments=c["function"]["arguments"]) for c in events.calls]


def _metadata(grpc_context, key: str) -> str:
    if grpc_context is None:
        return ""
    for name, value in grpc_context.invocation_metadata():
        if name == key and isinstance(value, str):
            return value
    return ""


def request_id_of(grpc_context) -> str:
    given = _metadata(grpc_context, REQUEST_ID_KEY) or _metadata(grpc_context, SERVE_REQUEST_ID_KEY)
    return given[:128] if given and given.isprintable() else uuid.uuid4().hex


class GrpcServiceMixin:
    """GenerateService methods for RouterDeployment; uses its admission, config, created, api_metrics,
    telemetry, _start and _count_rejection."""

    async def Generate(
        self, request: pb.GenerateRequest, grpc_context=None
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request_id_of(grpc_context)
        if grpc_context is not None:  # Serve sends it with the responses (an error status carries it in its details)
            grpc_context.set_trailing_metadata([(REQUEST_ID_KEY, request_id)])
        try:
            prepared = self.admission.grpc(_metadata(grpc_context, "authorization"), request.ByteSize(),
                                           lambda: request_body(request), self.num_inflight)
            parent = self.telemetry.tracing.context_from_headers(
                grpc_context.invocation_metadata() if grpc_context is not None else None)
            meta, events = await self._start(prepared, request_id, parent)
        except APIError as err:
            raise self._grpc_reject(err, "grpc_generate", grpc_context, request_id) from None
        except Exception as exc:  # a bug, not the client's: logged, and the client gets a stable message
            err = upstream_error(exc, self.config.retry_after_s)
            raise self._grpc_reject(err, "grpc_generate", grpc_context, request_id) from None
        num_tokens = 0
        tools = ([ToolCallStream(prepared.tools) for _ in range(prepared.num_choices)]
                 if prepared.tools is not None else None)
        status = "200"  # counted when the stream ends: a failure after the first message has a label of its own
        # one message per choice per batch: whatever arrived while the previous message was on its way
        source = batches(events, self.config.stream_interval_s) if self.config.stream_interval_s is not None else None
        try:
            async for batch in source if source is not None else singles(events):
                if source is not None:
                    batch = by_choice(batch)
                for index, event in batch:
                    num_tokens += len(event.token_ids)
                    yield response_chunk(meta, index, event, prepared.want_logprobs,
                                         tools[index] if tools is not None else None)
            if prepared.include_usage:
                prompt_tokens = len(prepared.prompt_token_ids)
                yield pb.GenerateResponse(id=meta.id, model=meta.model, usage=pb.Usage(
                    prompt_tokens=prompt_tokens, completion_tokens=num_tokens,
                    total_tokens=prompt_tokens + num_tokens))
        except Exception as exc:
            err = upstream_error(exc, self.config.retry_after_s)
            status = "error_after_first_token" if num_tokens else str(err.status)
            raise _abort(grpc_context, grpc_status(err.status), err.message, request_id) from None
        except (GeneratorExit, asyncio.CancelledError):  # the client cancelled the call
            status = "client_disconnected"
            raise
        finally:
            self.api_metrics.requests.labels("grpc_generate", status).inc()
            if source is not None:
                await source.aclose()  # first: it reads `events` in a task of its own
            await events.aclose()

    async def Models(self, request: pb.ModelsRequest, grpc_context=None) -> pb.ModelsResponse:
        try:
            self.admission.authorize(_metadata(grpc_context, "authorization"))
        except APIError as err:
            raise self._grpc_reject(err, "grpc_models", grpc_context, request_id_of(grpc_context)) from None
        listing = oa.model_list(self.config.served_model_name, self.config.max_model_len, self.created)
        return pb.ModelsResponse(models=[
            pb.Model(id=m["id"], created=m["created"], owned_by=m["owned_by"],
                     max_model_len=m["max_model_len"])
            for m in listing["data"]
        ])

    def _grpc_reject(self, err: APIError, endpoint: str, grpc_context, request_id: str) -> Exception:
        self._count_rejection(err, endpoint)
        return _abort(grpc_context, grpc_status(err.status), err.message, request_id)


def error_details(message: str, request_id: str) -> str:
    """An error status's details: the stable message, then the request id (Serve's proxy drops the trailing
    metadata of an RPC that fails, so the details are the one place a client finds it)."""
    return f"{message} (request id {request_id})"


def _abort(grpc_context, code: grpc.StatusCode, message: str, request_id: str) -> Exception:
    """The exception that ends an RPC with `code`: Serve wraps it with the code set on the context.
    A builtin type, so the proxy can unpickle it without importing the router."""
    details = error_details(message, request_id)
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(details)
    return RuntimeError(details)
