"""The router's gRPC GenerateService (pdserve/v1/generate.proto), served by Ray Serve's gRPC proxy.

A GenerateRequest becomes the very body the HTTP API would parse (completions, or chat when it
carries messages) and goes through the same admission (`_start`); events become GenerateResponse
deltas. Errors end the RPC with a status code: the code is set on Serve's gRPC context and an
exception raised, which is how Serve carries a user status through the proxy.
"""

# No `from __future__ import annotations`: the methods are inspected by Serve on an ingress class
# whose other methods FastAPI reads; keep every annotation a real object.

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pdserve.services.router import openai_api as oa
from pdserve.services.router.errors import APIError, bad_request
from pdserve.api.contract import TokenBatch
from pdserve.services.router.streaming import singles, by_choice, upstream_error
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
        body["messages"] = [
            {"role": m.role, "content": m.content, **({"name": m.name} if m.HasField("name") else {})}
            for m in request.messages.messages
        ]
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
    return body, chat


def response_chunk(
    meta: oa.ResponseMeta, index: int, event: TokenBatch, want_logprobs: bool
) -> pb.GenerateResponse:
    token_ids = list(event.token_ids)
    chunk = pb.GenerateResponse(id=meta.id, model=meta.model, index=index, text=event.text, token_ids=token_ids)
    if event.finished:
        chunk.finish_reason = event.finish_reason or ""
    logprobs = list(event.logprobs or ())
    if want_logprobs and token_ids and len(logprobs) == len(token_ids):
        top = list(event.top_logprobs or ())
        for k, lp in enumerate(logprobs):
            alternatives = top[k] if k < len(top) and top[k] else ()
            top_k = [pb.TopLogprob(token_id=i, logprob=p) for i, p in alternatives]
            chunk.logprobs.add(logprob=lp, top=top_k)
    return chunk


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
        status = "200"  # counted when the stream ends: a failure after the first message has a label of its own
        # one message per choice per batch: whatever arrived while the previous message was on its way
        source = batches(events, self.config.stream_interval_s) if self.config.stream_interval_s is not None else None
        try:
            async for batch in source if source is not None else singles(events):
                if source is not None:
                    batch = by_choice(batch)
                for index, event in batch:
                    num_tokens += len(event.token_ids)
                    yield response_chunk(meta, index, event, prepared.want_logprobs)
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
