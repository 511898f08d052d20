"""The router's end of the worker link: one channel per replica address, calls that raise the
link's own errors (WorkerUnavailable for a replica that is gone) rather than gRPC's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from pdserve.contract import DecodeEvent, HandoffParams, PrefillResult, WorkerRequest
from pdserve.worklink import codec
from pdserve.worklink.errors import WorkerLinkError, WorkerOverloaded, WorkerUnavailable
from pdserve.worklink.server import CHANNEL_OPTIONS, SERVICE, TOKEN_KEY

GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED)
IDLE_CHANNEL_S = 300.0


def link_error(exc: grpc.aio.AioRpcError) -> Exception:
    code, details = exc.code(), exc.details() or ""
    if code in GONE:
        return WorkerUnavailable(f"{code.name}: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return WorkerOverloaded(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(details)
    return WorkerLinkError(f"{code.name}: {details}")


class LinkStream:
    """A decode call's events; `cancel()` ends the call (the worker aborts the request)."""

    def __init__(self, call) -> None:
        self._call = call

    def cancel(self) -> None:
        self._call.cancel()

    async def __aiter__(self) -> AsyncIterator[DecodeEvent]:
        try:
            async for message in self._call:
                yield codec.unpack_event(message)
        except grpc.aio.AioRpcError as exc:
            raise link_error(exc) from None


class _Channel:
    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.prefill = self.channel.unary_unary(f"/{SERVICE}/Prefill")
        self.generate = self.channel.unary_stream(f"/{SERVICE}/Generate")
        self.abort = self.channel.unary_unary(f"/{SERVICE}/Abort")
        self.used_at = time.monotonic()


@dataclass(frozen=True)
class Link:
    """A replica's link: where it listens and the token it takes (both from its routing stats)."""

    address: str
    token: str = field(repr=False)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return ((TOKEN_KEY, self.token),)


class LinkClient:
    def __init__(self) -> None:
        self._channels: dict[str, _Channel] = {}
        self._closing: set[asyncio.Task] = set()

    def _channel(self, address: str) -> _Channel:
        now = time.monotonic()
        channel = self._channels.get(address)
        if channel is None:
            for old, c in list(self._channels.items()):  # replicas that went away leave idle channels
                if now - c.used_at > IDLE_CHANNEL_S:
                    del self._channels[old]
                    self._closing.add(asyncio.get_running_loop().create_task(c.channel.close()))
                    self._closing = {t for t in self._closing if not t.done()}
            channel = self._channels[address] = _Channel(address)
        channel.used_at = now
        return channel

    async def prefill(self, link: Link, request: WorkerRequest) -> PrefillResult:
        try:
            reply = await self._channel(link.address).prefill(codec.pack_call(request), metadata=link.metadata)
        except grpc.aio.AioRpcError as exc:
            raise link_error(exc) from None
        return codec.unpack_result(reply)

    def generate(self, link: Link, request: WorkerRequest, handoff: HandoffParams | None = None,
                 first_token_id: int | None = None) -> LinkStream:
        call = self._channel(link.address).generate(codec.pack_call(request, handoff, first_token_id),
                                                    metadata=link.metadata)
        return LinkStream(call)

    async def abort(self, link: Link, lease_id: str) -> bool:
        try:
            return await self._channel(link.address).abort(lease_id.encode(), metadata=link.metadata) == b"\x01"
        except grpc.aio.AioRpcError as exc:
            raise link_error(exc) from None

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for c in channels:
            await c.channel.close()
