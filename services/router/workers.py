"""The router's view of the worker pools: how a call reaches a prefill or decode replica.

A call to a replica whose link address the stats poller has seen goes over the worker link
(`pdserve.worklink`); any other through Serve's deployment handle, which picks the replica when none is
named (and PlacementRequestRouter honours the one named). Callers never choose between the two.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from pdserve.api.contract import HandoffParams, KVPart, PrefillResult, WorkerRequest
from pdserve.services.router.replica_stats import ReplicaStats, ReplicaStatsPoller
from pdserve.worklink import Link, LinkClient


class Workers:
    def __init__(
        self, prefill: Any, decode: Any, poller: ReplicaStatsPoller,
        count_call: Callable[[str, str], None] = lambda role, path: None,
    ) -> None:
        """`prefill`, `decode`: deployment handles (prefill None in colocated mode); `poller`: the stats
        poller, which knows each replica's link and holds the link client (None: the link is off);
        `count_call(role, "link" | "serve")` counts each call by its path."""
        self.prefill_handle = prefill
        self.decode_handle = decode
        self.poller = poller
        self.count_call = count_call

    @property
    def links(self) -> LinkClient | None:
        return self.poller.links

    def link(self, role: str, replica: str | None) -> Link | None:
        return None if replica is None else self.poller.link(role, replica)

    def prefill(self, request: WorkerRequest) -> asyncio.Future[PrefillResult] | Any:
        """The prefill call on `request.replica` (awaitable)."""
        address = self.link("prefill", request.replica)
        self.count_call("prefill", "link" if address else "serve")
        if address:
            return self.links.prefill(address, request)
        return self.prefill_handle.prefill.remote(request)

    def generate(self, request: WorkerRequest, handoff: HandoffParams | None = None,
                 first_token_id: int | None = None) -> Any:
        """The decode call's event stream (async iterable, `.cancel()`-able); a handoff comes with prefill's
        first token."""
        handoff_args = () if handoff is None else (handoff, first_token_id)
        address = self.link("decode", request.replica)
        self.count_call("decode", "link" if address else "serve")
        if address:
            return self.links.generate(address, request, *handoff_args)
        return self.decode_handle.options(stream=True).generate.remote(request, *handoff_args)

    def prefill_stream(self, request: WorkerRequest) -> Any:
        """The prefill call that streams the KV's parts, then the result (async iterable, `.cancel()`-able)."""
        address = self.link("prefill", request.replica)
        self.count_call("prefill", "link" if address else "serve")
        if address:
            return self.links.prefill_stream(address, request)
        return self.prefill_handle.options(stream=True).prefill_stream.remote(request)

    def kv_part(self, request: WorkerRequest, part: KVPart) -> Any:
        """Has the decode replica `request.replica` pull a part of the request's KV (awaitable: staged or not)."""
        address = self.link("decode", request.replica)
        if address:
            return self.links.kv_part(address, request, part)
        return self.decode_handle.kv_part.remote(request, part)

    def drop_staged(self, request: WorkerRequest) -> Any:
        """Frees the parts the decode replica staged for `request` (awaitable)."""
        address = self.link("decode", request.replica)
        if address:
            return self.links.abort(address, request.request_id)
        return self.decode_handle.drop_staged.remote(request)

    def abort(self, replica: str | None, lease_id: str) -> Any:
        """Frees a prefill lease on the replica that holds it (awaitable)."""
        address = self.link("prefill", replica)
        if address:
            return self.links.abort(address, lease_id)
        return self.prefill_handle.abort.remote(lease_id)

    def forget(self, role: str, replica: str) -> None:
        """A replica found dead: out of placement and link lookups until it answers a poll again."""
        self.poller.forget(role, replica)

    def live(self, role: str) -> list[ReplicaStats]:
        """The role's replicas that answer their polls."""
        return self.poller.snapshots(role)
