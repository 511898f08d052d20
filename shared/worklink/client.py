"""The router's end of the worker link: pooled connections per replica address, calls that raise the
link's own errors (WorkerUnavailable for a replica that is gone or unreachable)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.api.contract import DecodeEvent, HandoffParams, KVPart, PrefillResult, WorkerRequest
from pdserve.worklink import codec
from pdserve.worklink.errors import WorkerLinkError, WorkerOverloaded, WorkerUnavailable
from pdserve.worklink.frames import FrameError, FrameReader, Kind, Status, frame, parse_error, tune

MAX_IDLE_PER_REPLICA = 64
CONNECT_TIMEOUT_S = 5.0
# a stream's frames the router has not read yet, before the connection stops reading from the socket
PAUSE_AT, RESUME_AT = 256, 32


def call_error(payload: bytes) -> Exception:
    status, message = parse_error(payload)
    if status == Status.RESOURCE_EXHAUSTED:
        return WorkerOverloaded(message)
    if status == Status.INVALID_ARGUMENT:
        return ValueError(message)
    if status == Status.UNAVAILABLE:
        return WorkerUnavailable(message)
    return WorkerLinkError(f"{status.name if status else 'UNKNOWN'}: {message}")


def reusable(kind: Kind, payload: bytes) -> bool:
    """Whether a connection whose call ended with this frame takes the next call (a refused token
    ends the connection)."""
    return kind in (Kind.DATA, Kind.END) or (kind == Kind.ERROR and parse_error(payload)[0] != Status.UNAUTHENTICATED)


@dataclass(frozen=True)
class Link:
    """A replica's link: where it listens and the token it takes (both from its routing stats)."""

    address: str
    token: str = field(repr=False)

    @property
    def host_port(self) -> tuple[str, int]:
        host, _, port = self.address.rpartition(":")
        return host.strip("[]"), int(port)


class _Connection(asyncio.Protocol):
    """Frames from the worker into a queue; a lost connection is a `None` at its end."""

    def __init__(self) -> None:
        self.reader = FrameReader()
        self.frames: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self.paused = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        tune(transport)

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.frames.put_nowait(None)

    def data_received(self, data: bytes) -> None:
        try:
            for item in self.reader.feed(data):
                self.frames.put_nowait(item)
        except FrameError:
            self.transport.abort()
            return
        if self.frames.qsize() >= PAUSE_AT and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    async def next_frame(self) -> tuple[Kind, bytes]:
        item = await self.frames.get()
        if self.paused and self.frames.qsize() <= RESUME_AT:
            self.paused = False
            self.transport.resume_reading()
        if item is None:
            self.frames.put_nowait(None)  # stays closed for whoever asks next
            raise WorkerUnavailable("the worker closed the link")
        return item

    def close(self) -> None:
        self.closed = True
        self.transport.abort()


class LinkStream:
    """A streaming call's events (a decode's, or a prefill's parts and result); `cancel()` ends the call
    (the worker aborts the request). The call starts when the stream is first iterated."""

    def __init__(self, client: LinkClient, link: Link, payload: bytes, kind: Kind = Kind.GENERATE) -> None:
        self._client, self._link, self._payload, self._kind = client, link, payload, kind
        self._unpack = codec.unpack_prefill_event if kind == Kind.PREFILL_STREAM else codec.unpack_event
        self._connection: _Connection | None = None
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True
        if self._connection is not None:
            self._connection.close()

    async def __aiter__(self) -> AsyncIterator[DecodeEvent]:
        if self._cancelled:
            return
        connection = self._connection = await self._client.send(self._link, self._kind, self._payload)
        ended = False
        try:
            while True:
                kind, payload = await connection.next_frame()
                if kind == Kind.DATA:
                    yield self._unpack(payload)
                elif kind == Kind.END:
                    ended = True
                    return
                else:
                    ended = reusable(kind, payload)
                    if kind == Kind.ERROR:
                        raise call_error(payload)
                    raise WorkerLinkError(f"unexpected {kind.name} frame")
        finally:
            self._client.done(self._link, connection, ended)


class LinkClient:
    def __init__(self) -> None:
        self._idle: dict[Link, list[_Connection]] = {}

    async def _connect(self, link: Link) -> _Connection:
        # replicas that went away leave closed connections behind
        self._idle = {k: live for k, v in self._idle.items() if (live := [c for c in v if not c.closed])}
        host, port = link.host_port
        try:
            connect = asyncio.get_running_loop().create_connection(_Connection, host, port)
            _, connection = await asyncio.wait_for(connect, CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            raise WorkerUnavailable(f"cannot reach the worker at {link.address}: {exc}") from None
        connection.transport.write(frame(Kind.HELLO, link.token.encode()))
        return connection

    async def send(self, link: Link, kind: Kind, payload: bytes) -> _Connection:
        """Starts a call on an idle connection to `link` (or a new one); its frames follow on it."""
        idle = self._idle.get(link)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                break
        else:
            connection = await self._connect(link)
        connection.transport.write(frame(kind, payload))
        return connection

    def done(self, link: Link, connection: _Connection, clean: bool) -> None:
        """A call on `connection` is over: back to the pool if it ended cleanly, closed if not (a
        call cut short is cancelled on the worker by the close)."""
        idle = self._idle.setdefault(link, [])
        if clean and not connection.closed and len(idle) < MAX_IDLE_PER_REPLICA:
            idle.append(connection)
        elif not connection.closed:
            connection.close()

    async def unary(self, link: Link, kind: Kind, payload: bytes) -> bytes:
        connection = await self.send(link, kind, payload)
        clean = False
        try:
            reply, body = await connection.next_frame()
            clean = reusable(reply, body)
            if reply == Kind.ERROR:
                raise call_error(body)
            if reply != Kind.DATA:
                raise WorkerLinkError(f"unexpected {reply.name} frame")
            return body
        finally:
            self.done(link, connection, clean)

    async def prefill(self, link: Link, request: WorkerRequest) -> PrefillResult:
        return codec.unpack_result(await self.unary(link, Kind.PREFILL, codec.pack_call(request)))

    def generate(self, link: Link, request: WorkerRequest, handoff: HandoffParams | None = None,
                 first_token_id: int | None = None) -> LinkStream:
        return LinkStream(self, link, codec.pack_call(request, handoff, first_token_id))

    def prefill_stream(self, link: Link, request: WorkerRequest) -> LinkStream:
        return LinkStream(self, link, codec.pack_call(request), Kind.PREFILL_STREAM)

    async def kv_part(self, link: Link, request: WorkerRequest, part: KVPart) -> bool:
        payload = codec.pack_call(request, part.params, part.num_prompt_tokens)
        return await self.unary(link, Kind.KV_PART, payload) == b"\x01"

    async def stats(self, link: Link, want_events: bool = False, cursor: tuple | None = None) -> dict:
        """The replica's routing stats; with `want_events`, under "kv_events" its pool's KV events after
        `cursor` (None: everything it holds)."""
        return codec.unpack_stats(await self.unary(link, Kind.STATS, codec.pack_stats_query(want_events, cursor)))

    async def abort(self, link: Link, lease_id: str) -> bool:
        return await self.unary(link, Kind.ABORT, lease_id.encode()) == b"\x01"

    async def close(self) -> None:
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()
