"""The worker link's wire format: length-prefixed frames over one TCP connection, one call at a time.

A frame is a 5-byte header (payload length, big-endian u32; kind, u8) and the payload. A connection
opens with HELLO (the replica's link token), then carries calls in turn: a call frame from the client,
then the worker's DATA frames (one for a unary call; a stream's events, then END) or one ERROR. Closing
the connection cancels the call in flight. Payloads are msgpack from pdserve.worklink.codec; nothing
here executes what it reads, and a frame over MAX_FRAME_BYTES ends the connection.
"""

from __future__ import annotations

import enum
import socket
import struct
from collections.abc import Iterator

HEADER = struct.Struct("!IB")
MAX_FRAME_BYTES = 64 << 20
MAX_HELLO_BYTES = 1024  # what a connection may send before its token is checked


class Kind(enum.IntEnum):
    HELLO = 1
    PREFILL = 2
    GENERATE = 3
    ABORT = 4
    STATS = 5
    PREFILL_STREAM = 6
    KV_PART = 7
    DATA = 16
    END = 17
    ERROR = 18


CALLS = (Kind.PREFILL, Kind.GENERATE, Kind.ABORT, Kind.STATS, Kind.PREFILL_STREAM, Kind.KV_PART)


class Status(enum.IntEnum):
    """Why a call failed (an ERROR frame's first byte); named like gRPC's codes."""

    INVALID_ARGUMENT = 3
    RESOURCE_EXHAUSTED = 8
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


class FrameError(Exception):
    """The peer broke the wire format (an unknown kind, a frame too large)."""


def frame(kind: Kind, payload: bytes = b"") -> bytes:
    return HEADER.pack(len(payload), kind) + payload


def error_frame(status: Status, message: str) -> bytes:
    return frame(Kind.ERROR, bytes((status,)) + message.encode("utf-8", "replace"))


def parse_error(payload: bytes) -> tuple[Status | None, str]:
    code = payload[0] if payload else None
    status = Status(code) if code in Status._value2member_map_ else None
    return status, payload[1:].decode("utf-8", "replace")


class FrameReader:
    """Frames out of a byte stream that arrives in arbitrary pieces."""

    def __init__(self, max_bytes: int = MAX_FRAME_BYTES) -> None:
        self._buffer = bytearray()
        self.max_bytes = max_bytes

    def feed(self, data: bytes) -> Iterator[tuple[Kind, bytes]]:
        self._buffer += data
        while len(self._buffer) >= HEADER.size:
            length, kind = HEADER.unpack_from(self._buffer)
            if length > self.max_bytes:
                raise FrameError(f"frame of {length} bytes over the {self.max_bytes}-byte limit")
            if kind not in Kind._value2member_map_:
                raise FrameError(f"unknown frame kind {kind}")
            end = HEADER.size + length
            if len(self._buffer) < end:
                return
            payload = bytes(self._buffer[HEADER.size:end])
            del self._buffer[:end]
            yield Kind(kind), payload


def tune(transport) -> None:
    """No Nagle delay on small frames; dead peers on other hosts show within ~20 s with no traffic."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 2)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
