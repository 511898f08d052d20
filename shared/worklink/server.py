"""A replica's end of the worker link: a gRPC server on the replica's own event loop.

Three methods, bytes in and out (pdserve.worklink.codec): Prefill (unary), Generate (server stream)
and Abort (unary, a lease id). A client that cancels or disconnects cancels the handler, which closes
the decode stream (the engine aborts the request) or lets prefill free its lease. Worker failures
reach the client as a status and a fixed message; the details go to this replica's log.

Every call carries the replica's link token (metadata `TOKEN_KEY`), which the replica makes at start
and publishes only in its routing stats (read over Ray's authenticated channels); a call without it
is refused, compared in constant time. The token authenticates; it does not encrypt (the link is plaintext gRPC, like Ray's).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

import grpc

from pdserve.contract import DecodeEvent, HandoffParams, PrefillResult, WorkerRequest
from pdserve.worklink import codec

logger = logging.getLogger(__name__)
SERVICE = "pdserve.WorkerLink"
TOKEN_KEY = "x-pdserve-link-token"
MAX_MESSAGE_BYTES = 64 << 20
# dead peers on other hosts show within ~15 s even with no stream traffic
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
                                    ("grpc.so_reuseport", 0)]

Prefill = Callable[[WorkerRequest], Awaitable[PrefillResult]]
Generate = Callable[[WorkerRequest, HandoffParams | None, int | None], AsyncIterator[DecodeEvent]]
Abort = Callable[[str], Awaitable[bool]]


class LinkServer:
    """Runs at most `max_ongoing` prefill/generate calls at once and queues up to `max_queued` more
    (Serve's own bounds for its handles, from the same WorkerConfig); past that a call is refused with
    RESOURCE_EXHAUSTED, which the router answers 503 with Retry-After."""

    def __init__(self, token: str, *, prefill: Prefill | None = None, generate: Generate | None = None,
                 abort: Abort | None = None, max_ongoing: int = 1024, max_queued: int = 1024) -> None:
        if not token:
            raise ValueError("a link server needs a token")
        self._token = token.encode()
        self._prefill, self._generate, self._abort = prefill, generate, abort
        self.max_ongoing, self.max_queued = max_ongoing, max_queued
        self.num_in_flight = self.num_queued = 0
        self._slots: asyncio.Semaphore | None = None
        self.address: str | None = None
        self._server: grpc.aio.Server | None = None

    async def start(self, host: str) -> str:
        """Binds `host` on a free port (idempotent); returns "host:port"."""
        if self._server is None:
            server = grpc.aio.server(options=SERVER_OPTIONS)
            methods = {"Abort": grpc.unary_unary_rpc_method_handler(self._on_abort)}
            if self._prefill is not None:
                methods["Prefill"] = grpc.unary_unary_rpc_method_handler(self._on_prefill)
            if self._generate is not None:
                methods["Generate"] = grpc.unary_stream_rpc_method_handler(self._on_generate)
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, methods)])
            port = server.add_insecure_port(f"{host}:0")
            await server.start()
            self._server, self.address = server, f"{host}:{port}"
        return self.address

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops taking calls; with `grace_s`, calls in flight get that long to end."""
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None

    async def _authenticate(self, context) -> None:
        presented = next((v for k, v in context.invocation_metadata() or () if k == TOKEN_KEY), "")
        if not hmac.compare_digest(presented.encode() if isinstance(presented, str) else presented, self._token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong link token")

    async def _admit(self, context) -> None:
        """Takes a slot (waiting in the queue if there is room) or refuses the call."""
        await self._authenticate(context)
        self._slots = self._slots or asyncio.Semaphore(self.max_ongoing)
        if self._slots.locked():
            if self.num_queued >= self.max_queued:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "replica is at its limit of calls")
            self.num_queued += 1
            try:
                await self._slots.acquire()
            finally:
                self.num_queued -= 1
        else:
            await self._slots.acquire()
        self.num_in_flight += 1

    def _release(self) -> None:
        self.num_in_flight -= 1
        self._slots.release()

    @staticmethod
    async def _fail(context, exc: Exception) -> None:
        if isinstance(exc, ValueError):  # a request the engine refuses (CodecError included)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        logger.exception("worker link call failed", exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, "worker failed")

    async def _on_prefill(self, data: bytes, context) -> bytes:
        await self._admit(context)
        try:
            request, _, _ = codec.unpack_call(data)
            return codec.pack_result(await self._prefill(request))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._fail(context, exc)
        finally:
            self._release()

    async def _on_generate(self, data: bytes, context) -> AsyncIterator[bytes]:
        await self._admit(context)
        try:
            request, handoff, first = codec.unpack_call(data)
            async with aclosing(self._generate(request, handoff, first)) as events:
                async for event in events:
                    yield codec.pack_event(event)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._fail(context, exc)
        finally:
            self._release()

    async def _on_abort(self, data: bytes, context) -> bytes:
        await self._authenticate(context)
        lease_id = data.decode("utf-8", "replace")
        released = await self._abort(lease_id) if self._abort is not None else False
        return b"\x01" if released else b"\x00"
