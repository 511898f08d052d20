"""UCX transport: the decode side pulls a lease's KV blocks straight out of the prefill pool.

One connection carries many pulls, one at a time (tag messages, matched in order):

    importer -> REQUEST   <4s H H 32s 32s I I>  b"PDKQ", version, flags 0, lease id and handoff secret (hex ascii),
                          num_blocks, num_segments
    importer -> SEGMENTS  num_segments x <I> run lengths; a segment is consecutive in both pools, so one message
    exporter -> STATUS    <4s H H I> b"PDKS", version, status, detail bytes; then the wire header's fixed prefix
    exporter -> DETAIL    the rest of the wire header (status OK) or a UTF-8 reason
    exporter -> PAYLOAD   one message per piece of a segment (at most _PIECE_BYTES), sent from the pool and
                          received into the pool (zero copy)
    importer -> ACK       b"\\x01" once the checksums verified; the exporter then releases the lease

The exporter serves a lease only to a request carrying the handoff's secret (compared in constant time);
a wrong or missing one gets the same refusal as an unknown lease, before any KV byte is sent.

Each side posts a step's messages together (request with segments; status, header and every payload
piece), so UCX moves them back to back; the importer verifies each piece while the next one lands.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import struct
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from pdserve.kvcache import wire
from pdserve.kvcache.layout import KVLayout, LayoutMismatch
from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.transports.base import KVTransferError, KVTransport, ReleaseFn
from pdserve.kvcache.transports.ucx_env import (
    UCXConfig, apply_ucx_env, create_listener, ucx_context, ucx_error,
)
from pdserve.kvcache.transports.ucx_io import EndpointPool, OperationKeeper, PostedOps, dest_runs, runs_of, segments_of, span

__all__ = ["UCXConfig", "UCXTransport", "apply_ucx_env"]

logger = logging.getLogger(__name__)

_VERSION = 2
_REQUEST = struct.Struct("<4sHH32s32sII")
_STATUS = struct.Struct("<4sHHI")
_WIRE_PREFIX = wire._HEAD.size  # the fixed part of the wire header that peek_num_blocks reads
_OK, _UNKNOWN_LEASE, _BAD_REQUEST = 0, 1, 2
_MAX_DETAIL = 1024
_ACK = b"\x01"
_PIECE_BYTES = 32 << 20  # payload message size bound: the unit of verify/receive overlap
_LEASE_ID = re.compile(r"[0-9a-f]{32}")
_SECRET_NBYTES = 32  # hex ascii of 16 random bytes
_NO_SECRET = bytes(_SECRET_NBYTES)
T = TypeVar("T")


class _Refused(KVTransferError):
    """The exporter answered with an error status; the connection stays in a clean state."""


@dataclass(frozen=True)
class _Export:
    block_ids: tuple[int, ...]
    header: bytes  # wire header, checksums taken at export time
    secret: bytes  # what a pull must present (HandoffParams.secret)


class UCXTransport(KVTransport):
    """Point-to-point pull over UCX. `host` is the address advertised in handoff params (the listener
    itself listens on every interface; see `create_listener`); `timeout_s` bounds every single network wait.

    Checksums are taken at export, so blocks overwritten before the pull fail verification. An
    export stays until the importer's ack (then `release`) or `forget()`: a failed transfer
    leaves it for a retry, so the owner forgets leases that expire in its engine.
    """

    name: ClassVar[str] = "ucx"

    def __init__(
        self, pool: KVPoolIO, layout: KVLayout, release: ReleaseFn | None = None, *,
        host: str = "127.0.0.1", port: int = 0, max_connections: int = 8, timeout_s: float = 10.0,
        config: UCXConfig | None = None,
    ) -> None:
        super().__init__(pool, layout, release)
        if layout.block_nbytes != pool.block_nbytes:
            raise LayoutMismatch(f"layout blocks are {layout.block_nbytes} bytes, pool blocks {pool.block_nbytes}")
        if max_connections < 1 or timeout_s <= 0:
            raise ValueError("max_connections must be >= 1 and timeout_s > 0")
        self.host, self.port, self.max_connections, self.timeout_s = host, port, max_connections, timeout_s
        self.config = config or UCXConfig.for_pool(pool)
        apply_ucx_env(self.config)
        self._listener: Any = None
        self._exports: dict[str, _Export] = {}
        self._serving: dict[str, _Export] = {}  # claimed by a connection, awaiting the ack
        self._server_eps: set[Any] = set()
        self._handlers: set[asyncio.Task] = set()
        self._peers: dict[tuple[str, int], EndpointPool] = {}
        self._keeper = OperationKeeper(timeout_s)  # failed and abandoned UCX work, until UCX lets go of it
        self._closed = False
        self.num_refused_pulls = 0  # unknown lease or wrong secret

    @property
    def num_exports(self) -> int:
        return len(self._exports) + len(self._serving)

    @property
    def num_connections_opened(self) -> int:
        return sum(p.num_created for p in self._peers.values())

    # ---- exporting side ----

    async def start(self) -> None:
        if self._listener is None:
            ucxx = ucx_context.acquire(self)
            self._listener = create_listener(ucxx, self._serve, self.port, self.config.endpoint_error_handling)
            self.port = self._listener.port

    async def export(
        self, lease_id: str, block_ids: list[int], block_hashes: list[int], num_tokens: int
    ) -> HandoffParams:
        if self._listener is None:
            raise RuntimeError("start() the UCX transport before exporting")
        if not _LEASE_ID.fullmatch(lease_id):
            raise ValueError(f"lease id {lease_id!r} is not 32 lowercase hex digits")
        if lease_id in self._exports or lease_id in self._serving:
            raise ValueError(f"lease {lease_id} is already exported")
        params = HandoffParams("ucx", self.layout.layout_hash, lease_id, num_tokens, tuple(block_ids),
                               tuple(block_hashes), address=self.host, port=self.port, secret=secrets.token_hex(16))
        # the table holds one hash per block; a partial tail block has none (0) and is never compared
        hashes = list(params.block_hashes) + [0] * (len(block_ids) - len(block_hashes))
        blocks = self.pool.read_blocks(params.block_ids)  # also checks the ids
        header = wire.encode_header(self.layout.layout_hash, self.pool.block_nbytes, hashes, blocks)
        self._exports[lease_id] = _Export(params.block_ids, header, params.secret.encode("ascii"))
        return params

    def forget(self, lease_id: str) -> bool:
        """Drop an export (request aborted, lease expired); the caller releases the lease in its engine."""
        return (self._exports.pop(lease_id, None) or self._serving.pop(lease_id, None)) is not None

    def exported_lease_ids(self) -> list[str]:
        return [*self._exports, *self._serving]

    async def _serve(self, ep: Any) -> None:
        task = asyncio.current_task()
        self._server_eps.add(ep)
        if task is not None:
            self._handlers.add(task)
        try:
            while not self._closed:
                request = bytearray(_REQUEST.size)
                await ep.recv(request)  # idle until the next pull; ends when the peer closes
                await self._serve_one(ep, request)
        except (KVTransferError, wire.WireError) as e:
            logger.warning("UCX export connection dropped: %s", e)
        except ucx_error() as e:
            logger.debug("UCX export connection closed: %s", e)
        finally:
            self._server_eps.discard(ep)
            self._handlers.discard(task)
            ep.abort()

    async def _serve_one(self, ep: Any, request: bytearray) -> None:
        magic, version, _, raw_lease, raw_secret, num_blocks, num_segments = _REQUEST.unpack(request)
        if magic != b"PDKQ" or version != _VERSION:
            raise wire.WireError(f"bad KV pull request (magic {bytes(magic)!r}, version {version})")
        if not 0 < num_segments <= num_blocks <= wire.DEFAULT_MAX_BLOCKS:
            raise wire.WireError(f"bad KV pull request: {num_segments} segments for {num_blocks} blocks")
        ops = PostedOps(ep)
        try:
            await self._serve_pull(ops, raw_lease.decode("ascii", "replace"), raw_secret, num_blocks, num_segments)
        except BaseException:
            await self._keeper.settle(ops)
            raise

    async def _serve_pull(
        self, ops: PostedOps, lease_id: str, secret: bytes, num_blocks: int, num_segments: int
    ) -> None:
        ep = ops.ep
        raw_lengths = bytearray(4 * num_segments)
        await self._step(ops.wait(ops.post(ep.recv(raw_lengths))), "receive the pull segments", "importer")
        lengths = list(struct.unpack(f"<{num_segments}I", raw_lengths))
        export = self._exports.get(lease_id)
        # one answer for unknown, busy and wrong secret: a peer learns nothing about leases it was not handed
        is_handed = hmac.compare_digest(secret, export.secret if export is not None else _NO_SECRET)
        if export is None or not is_handed:
            self.num_refused_pulls += 1
            return await self._refuse(ops, _UNKNOWN_LEASE, f"unknown, expired or busy lease {lease_id}")
        del self._exports[lease_id]
        runs = runs_of(export.block_ids, lengths)
        if runs is None or len(export.block_ids) != num_blocks:
            self._exports[lease_id] = export
            return await self._refuse(ops, _BAD_REQUEST, f"lease {lease_id} has {len(export.block_ids)} blocks; "
                                      f"request for {num_blocks} in segments {lengths}")
        self._serving[lease_id] = export
        is_acked = False
        try:
            head = _STATUS.pack(b"PDKS", _VERSION, _OK, len(export.header) - _WIRE_PREFIX)
            sends = [ops.post(ep.send(head + export.header[:_WIRE_PREFIX])), ops.post(ep.send(export.header[_WIRE_PREFIX:]))]
            sends += [ops.post(ep.send(span(self.pool, first, count))) for first, count in self._pieces(runs)]
            await self._step(ops.wait(*sends), "send KV blocks", "importer")
            ack = bytearray(1)
            await self._step(ops.wait(ops.post(ep.recv(ack))), "wait for the ack", "importer")
            is_acked = ack == _ACK
        finally:
            if self._serving.pop(lease_id, None) is not None:  # not forgotten meanwhile
                if not is_acked:
                    self._exports[lease_id] = export  # the importer may retry; expiry or forget() drops it
                else:
                    self.release_soon(lease_id)  # this connection serves its next pull at once

    async def _refuse(self, ops: PostedOps, status: int, reason: str) -> None:
        detail = reason.encode()[:_MAX_DETAIL]
        status_message = _STATUS.pack(b"PDKS", _VERSION, status, len(detail)) + bytes(_WIRE_PREFIX)
        await self._step(ops.wait(ops.post(ops.ep.send(status_message))), "send the status", "importer")
        await self._step(ops.wait(ops.post(ops.ep.send(detail))), "send the refusal", "importer")

    # ---- importing side ----

    async def pull(self, params: HandoffParams, dest_block_ids: list[int]) -> None:
        self._check_pull(params, dest_block_ids)
        if params.transport != self.name or params.address is None or params.port is None:
            raise ValueError(f"not a UCX handoff with a peer address: {params}")
        if not _LEASE_ID.fullmatch(params.lease_id):
            raise ValueError(f"lease id {params.lease_id!r} is not 32 lowercase hex digits")
        if len(params.secret) > _SECRET_NBYTES or not params.secret.isascii():
            raise ValueError(f"a handoff secret is at most {_SECRET_NBYTES} ascii characters")
        if len(set(dest_block_ids)) != len(dest_block_ids):
            raise ValueError(f"duplicate destination blocks {dest_block_ids}")
        for b in dest_block_ids:
            self.pool.block_tensor(b)  # IndexError before any I/O
        segments = segments_of(params.block_ids, dest_block_ids)
        peer = f"{params.address}:{params.port}"
        ep = await self._acquire(params.address, params.port, peer)
        endpoints = self._peers[(params.address, params.port)]
        try:
            is_clean = await self._exchange(ep, params, dest_block_ids, segments, peer)
        except BaseException as exc:
            refused = isinstance(exc, _Refused)
            endpoints.put(ep, reusable=refused and not self._closed)
            if not refused:
                for b in dest_block_ids:  # only after the abort above: no receive can still land
                    self.pool.block_tensor(b).zero_()
            raise
        endpoints.put(ep, reusable=is_clean and not self._closed)

    async def _acquire(self, address: str, port: int, peer: str) -> Any:
        if self._closed:
            raise KVTransferError("UCX transport is closed")
        endpoints = self._peers.setdefault((address, port), EndpointPool(self.max_connections))
        await self._step(endpoints.slots.acquire(), "wait for a free connection", peer)
        try:
            ep = endpoints.take_idle()
            if ep is None:
                ucxx = ucx_context.acquire(self)
                # never cancelled half-way (a cancelled connect leaves UCX calling back into freed objects):
                # a caller that goes meanwhile leaves it to finish, and the endpoint is then aborted
                connect = asyncio.ensure_future(ucxx.create_endpoint(
                    address, port, connect_timeout=self.timeout_s,
                    endpoint_error_handling=self.config.endpoint_error_handling))
                try:
                    ep = await self._step(asyncio.shield(connect), "connect", peer)
                except BaseException:
                    self._keeper.abandon_connect(connect)
                    raise
                endpoints.num_created += 1
            endpoints.busy.add(ep)
            return ep
        except BaseException:
            endpoints.slots.release()
            raise

    async def _exchange(
        self, ep: Any, params: HandoffParams, dest_block_ids: list[int], segments: list[tuple[int, int]], peer: str
    ) -> bool:
        """One pull on `ep`; True if the connection is left clean for reuse. On any failure or
        cancellation, every operation posted on `ep` has ended before this raises (`PostedOps`)."""
        ops = PostedOps(ep)
        try:
            return await self._exchange_on(ops, params, dest_block_ids, segments, peer)
        except BaseException:
            await self._keeper.settle(ops)
            raise

    async def _exchange_on(
        self, ops: PostedOps, params: HandoffParams, dest_block_ids: list[int], segments: list[tuple[int, int]],
        peer: str,
    ) -> bool:
        ep = ops.ep
        lease = params.lease_id
        request = _REQUEST.pack(b"PDKQ", _VERSION, 0, lease.encode("ascii"), params.secret.encode("ascii"),
                                len(dest_block_ids), len(segments))
        lengths = struct.pack(f"<{len(segments)}I", *(count for _, count in segments))
        status_buf = bytearray(_STATUS.size + _WIRE_PREFIX)
        await self._step(ops.wait(ops.post(ep.send(request)), ops.post(ep.send(lengths)), ops.post(ep.recv(status_buf))),
                         "send the pull request and receive the status", peer)
        magic, version, status, detail_nbytes = _STATUS.unpack_from(status_buf)
        if magic != b"PDKS" or version != _VERSION:
            raise KVTransferError(f"{peer} is not a pdserve KV exporter (magic {bytes(magic)!r}, version {version})")
        if status != _OK:
            if detail_nbytes > _MAX_DETAIL:
                raise KVTransferError(f"{peer} sent an oversized refusal ({detail_nbytes} bytes)")
            detail = bytearray(detail_nbytes)
            if detail_nbytes:
                await self._step(ops.wait(ops.post(ep.recv(detail))), "receive the refusal", peer)
            raise _Refused(f"KV exporter {peer} refused lease {lease} (status {status}): {detail.decode(errors='replace')}")
        prefix = bytes(status_buf[_STATUS.size:])
        num_blocks = wire.peek_num_blocks(prefix)
        if num_blocks != len(dest_block_ids) or detail_nbytes != wire.header_size(num_blocks) - _WIRE_PREFIX:
            raise wire.WireError(f"KV header announces {num_blocks} blocks, the handoff has {len(dest_block_ids)}")
        rest = bytearray(detail_nbytes)
        pieces = self._pieces(dest_runs(dest_block_ids, segments))
        # posted at once: the exporter sends them back to back
        receives = [ops.post(ep.recv(rest))] + [ops.post(ep.recv(span(self.pool, first, count))) for first, count in pieces]
        await self._step(ops.wait(receives[0]), "receive the KV header", peer)
        header = wire.decode_header(prefix + rest, self.layout.layout_hash, self.pool.block_nbytes,
                                    max_blocks=len(dest_block_ids))
        if header.block_hashes[: len(params.block_hashes)] != params.block_hashes:
            raise wire.WireError(f"KV blocks from {peer} are not the ones the handoff of lease {lease} names")
        verified = 0
        for received, (first, count) in zip(receives[1:], pieces):
            await self._step(ops.wait(received), "receive KV blocks", peer)
            wire.verify_block_run(header, verified, self.pool.read_blocks(range(first, first + count)))
            verified += count
        self.bytes_pulled += header.nbytes + header.payload_nbytes
        try:
            await self._step(ep.send(_ACK), "send the ack", peer)
        except KVTransferError as e:  # the blocks are verified: keep them; the exporter's lease expires instead
            logger.warning("%s; lease %s stays held on the exporter until it expires", e, lease)
            return False
        return True

    def _pieces(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Runs of (first block, count) cut into payload messages of at most _PIECE_BYTES; both sides cut alike."""
        limit = max(1, _PIECE_BYTES // self.pool.block_nbytes)
        return [(first + k, min(limit, count - k)) for first, count in runs for k in range(0, count, limit)]

    async def _step(self, awaitable: Awaitable[T], what: str, peer: str) -> T:
        try:
            return await asyncio.wait_for(awaitable, self.timeout_s)
        except TimeoutError:
            raise KVTransferError(f"UCX: {what} with {peer} timed out after {self.timeout_s:g}s") from None
        except ucx_error() as e:
            raise KVTransferError(f"UCX: {what} with {peer} failed: {type(e).__name__}: {e}") from e

    async def close(self) -> None:
        self._closed = True
        for endpoints in self._peers.values():
            endpoints.close()
        for ep in list(self._server_eps):
            ep.abort()  # their handlers' pending receives fail and the handlers return
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=self.timeout_s)
        await self.settle_releases(self.timeout_s)
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._exports.clear()
        self._serving.clear()
        ucx_context.release(self)
