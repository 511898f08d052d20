"""An asyncio client for pdserve's GenerateService; needs only grpcio and protobuf.

    async with GenerateClient("127.0.0.1:9000", api_key="sk-...") as client:
        async for chunk in client.generate(model="tiny", text="Hello", max_tokens=16):
            print(chunk.text, end="")

Errors arrive as `grpc.aio.AioRpcError` with the status code the server chose.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import grpc

from pdserve.v1 import generate_pb2 as pb
from pdserve.v1 import generate_pb2_grpc as pb_grpc


class GenerateClient:
    """`application` names the Serve application to reach when the proxy serves several."""

    def __init__(self, target: str, api_key: str | None = None, *, application: str | None = None) -> None:
        self.target = target
        self._metadata: list[tuple[str, str]] = []
        if api_key is not None:
            self._metadata.append(("authorization", f"Bearer {api_key}"))
        if application is not None:
            self._metadata.append(("application", application))
        self._channel = grpc.aio.insecure_channel(target)
        self._stub = pb_grpc.GenerateServiceStub(self._channel)

    def _call_metadata(self, request_id: str | None) -> list[tuple[str, str]]:
        return self._metadata + ([("x-request-id", request_id)] if request_id else [])

    def stream(
        self, request: pb.GenerateRequest, *, request_id: str | None = None, timeout: float | None = None
    ) -> grpc.aio.UnaryStreamCall:
        """The raw call: iterate it, or `cancel()` it to abort the request on the server."""
        return self._stub.Generate(request, metadata=self._call_metadata(request_id), timeout=timeout)

    async def generate(
        self,
        *,
        model: str,
        text: str | None = None,
        token_ids: Iterable[int] | None = None,
        messages: Iterable[Mapping[str, str]] | None = None,
        request_id: str | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Streams the deltas of a request built from exactly one of text, token_ids or messages,
        plus any GenerateRequest field in `params` (max_tokens, temperature, stop, ...)."""
        call = self.stream(build_request(model, text, token_ids, messages, **params),
                           request_id=request_id, timeout=timeout)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()  # no-op once the stream completed; aborts it if the caller stopped early

    async def models(self, *, timeout: float | None = None) -> list[pb.Model]:
        response = await self._stub.Models(pb.ModelsRequest(), metadata=self._call_metadata(None),
                                           timeout=timeout)
        return list(response.models)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> GenerateClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def build_request(
    model: str,
    text: str | None = None,
    token_ids: Iterable[int] | None = None,
    messages: Iterable[Mapping[str, str]] | None = None,
    **params: Any,
) -> pb.GenerateRequest:
    given = [x is not None for x in (text, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("pass exactly one of text, token_ids or messages")
    request = pb.GenerateRequest(model=model, **params)
    if text is not None:
        request.text = text
    elif token_ids is not None:
        request.token_ids.SetInParent()  # an empty list still selects token_ids
        request.token_ids.ids.extend(token_ids)
    else:
        request.messages.SetInParent()
        request.messages.messages.extend(pb.ChatMessage(**m) for m in messages)
    return request
