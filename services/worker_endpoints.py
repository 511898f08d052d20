"""What prefill and decode replicas both answer: engine stats, metrics snapshots, routing stats, and
the worker link (pdserve.worklink), whose address the routing stats publish."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import time
from typing import TYPE_CHECKING, Any

from pdserve.observability import trace_attributes as ta
from pdserve.api.contract import WorkerRequest
from pdserve.worklink import LinkServer

if TYPE_CHECKING:  # the engine's modules load torch: Serve's driver imports this module only to bind
    from pdserve.engine.prefix_pull import PrefixPull, PrefixPuller
    from pdserve.kvcache.transports.base import KVTransport


class WorkerEndpoints:
    """Mixin over a deployment's `config` (WorkerConfig), `engine` (AsyncLLMEngine) and `telemetry`
    (pdserve.observability.telemetry.Telemetry); `link_server()` says which calls its link serves."""

    link: LinkServer | None = None
    link_token = ""
    draining = False
    # since start, for the autoscaling policy's rates (record_autoscaling_stats)
    num_requests = num_prompt_tokens = num_prompt_tokens_sq = num_output_tokens = 0
    _layout_hash: int | None = None  # the KV layout's, fixed for the engine's life

    def link_server(self) -> LinkServer:
        raise NotImplementedError

    prefix_puller: PrefixPuller | None = None  # the Redis tier, when the KV transport is redis
    transport: KVTransport | None = None  # the KV handoff's transport

    async def __del__(self) -> None:
        """Serve's graceful shutdown, after Serve's own calls drained: stop taking link calls (the router
        goes elsewhere) while those in flight end, wait for this replica's KV exports to be pulled (no
        lease stranded), then end the engine's streams, close the KV transport (its listener and
        connections) and flush the tracer, in that order. An autoscaled role drains for up to its
        `autoscaling.drain_timeout_s`; otherwise link calls get 1 s and exports are not waited for."""
        self.draining = True
        scaling = self.config.autoscaling
        grace = scaling.drain_timeout_s if scaling is not None and scaling.policy != "static" else None
        deadline = time.monotonic() + (grace or 0.0)
        if self.link is not None:
            await self.link.stop(grace_s=grace if grace is not None else 1.0)
        while (self.transport is not None and self.transport.num_exports
               and time.monotonic() < deadline):
            await asyncio.sleep(0.05)
        await self.engine.close()
        if self.transport is not None:
            await self.transport.close()
        self.telemetry.close()

    def count_arrival(self, num_prompt_tokens: int) -> None:
        self.num_requests += 1
        self.num_prompt_tokens += num_prompt_tokens
        self.num_prompt_tokens_sq += num_prompt_tokens * num_prompt_tokens

    def count_output(self, num_tokens: int) -> None:
        self.num_output_tokens += num_tokens

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics (pdserve.autoscale.serve_policy.METRICS): engine gauges and
        settings, and counters since start; recorded every `metrics_interval_s` when autoscaling is on."""
        stats = self.engine.stats()
        return {
            "queued_prefill_tokens": stats.queued_prefill_tokens, "num_running": stats.num_running,
            "num_used_blocks": stats.num_total_blocks - stats.num_free_blocks,
            "num_total_blocks": stats.num_total_blocks, "block_size": stats.block_size,
            "max_num_seqs": self.config.max_num_seqs, "max_num_batched_tokens": stats.max_num_batched_tokens,
            "num_requests": self.num_requests, "prompt_tokens": self.num_prompt_tokens,
            "prompt_tokens_sq": self.num_prompt_tokens_sq, "output_tokens": self.num_output_tokens,
        }

    # async, as every endpoint here: Serve runs a sync method on a worker thread (a thread per call on the
    # 2-core VM), beside the engine loop that alone may read the engine between steps
    async def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.engine.stats())

    async def kv_transfer_stats(self) -> dict[str, Any]:
        """KV pulls by the path they took ("shm", "ucx", "shm_unreachable": shared memory not reachable, so
        UCX), where the transport chooses one, and the exports it holds."""
        transport = self.transport
        staging = getattr(self, "staging", None)  # decode: parts of handoffs pulled while their prefill ran
        engine = self.engine.stats()
        return {"pid": os.getpid(), "num_leased_blocks": engine.num_leased_blocks,
                "num_free_blocks": engine.num_free_blocks, "num_total_blocks": engine.num_total_blocks, "pulls_by_path": dict(getattr(transport, "pulls_by_path", {})),
                "num_exports": transport.num_exports if transport is not None else 0,
                "num_parts_staged": staging.num_parts_staged if staging is not None else 0,
                "num_staged_imports": len(staging) if staging is not None else 0,
                "staged_import_failures": dict(staging.failures) if staging is not None else {},
                "last_refusal": getattr(staging, "last_refusal", "")}

    async def metrics_snapshot(self, target: dict[str, Any] | None = None) -> dict[str, Any]:
        """`target` ({"replica": id}) only steers the call to this replica; see PlacementRequestRouter."""
        metrics = self.telemetry.metrics
        leases = self.engine.engine.leases
        metrics.set_kv_leases("held", len(leases))
        metrics.set_kv_lease_ages(leases.oldest_age_s(), self.engine.engine.num_expired_leases)
        metrics.set_kv_leases("exported", self.transport.num_exports if self.transport is not None else 0)
        return self.telemetry.worker_snapshot(self.engine.stats())

    async def record_routing_stats(self) -> dict[str, Any]:
        """Polled by Serve, and by the router until it has this replica's link: EngineStats, this replica's
        id, and its link's address and token (the link starts on the first poll, on the replica's event
        loop). The token travels only in these replies, over Ray's own authenticated channels."""
        if self.link is None:
            self.link_token = secrets.token_urlsafe(32)
            self.link = self.link_server()
        # a draining replica's stopped link stays stopped: its old address refuses, the router goes elsewhere
        address = self.link.address if self.draining else await self.link.start(self.config.resolved_ucx_host())
        return {**self._routing_stats(), "link": address, "link_token": self.link_token}

    async def link_stats(self, want_events: bool, cursor: tuple | None) -> dict[str, Any]:
        """The router's poll over the link (its STATS call): the routing stats, and with `want_events` the
        pool's KV events after `cursor` under "kv_events"; one round trip instead of two Serve calls."""
        stats = self._routing_stats()
        if want_events:
            stats["kv_events"] = self.kv_events({"cursor": cursor})
        return stats

    def _routing_stats(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.engine.stats()), "replica": self.telemetry.replica}

    def kv_events(self, target: dict[str, Any]) -> dict[str, Any]:
        """The pool's prefix-cache events after the router's cursor (`target["cursor"]`: [epoch, seq]), or
        all it holds (pdserve.kv_events), with this replica's id and KV layout hash (the Redis tier's key
        space). `target["replica"]` steers the call to this replica; see PlacementRequestRouter."""
        batch = self.engine.kv_events.read(target.get("cursor")).to_dict()
        if self._layout_hash is None:
            from pdserve.engine.handoff import engine_layout

            self._layout_hash = engine_layout(self.engine).layout_hash
        return {**batch, "replica": self.telemetry.replica, "layout_hash": self._layout_hash}

    async def pull_prefix(self, request: WorkerRequest, span: Any) -> PrefixPull | None:
        """The request's leading blocks that placement found in the Redis tier, into the pool before the
        prompt is admitted; a failed pull is counted (pdserve_fallbacks_total{reason="prefix_..."}) and
        the prompt recomputed."""
        if not request.prefix_pull_blocks or self.prefix_puller is None:
            return None
        pull = await self.prefix_puller.pull(request.prompt_token_ids, request.prefix_pull_blocks)
        if pull.failure is not None:
            self.telemetry.metrics.count_fallback(f"prefix_{pull.failure}")
            span.add_event(ta.EVENT_FALLBACK, {ta.FALLBACK_REASON: f"prefix_{pull.failure}", "error": pull.error or ""})
        return pull

    def count_prefix_hits(self, pull: PrefixPull | None, num_cached_tokens: int, span: Any) -> None:
        """The engine's prefix hit by source, in metrics and on the span."""
        sources = pull.hit_sources(num_cached_tokens) if pull is not None else {"local": num_cached_tokens, "redis": 0}
        for source, n in sources.items():
            if n:
                self.telemetry.metrics.add_prefix_cache_hit_tokens(n, source)
        span.set_attributes({ta.PREFIX_CACHE_HIT_TOKENS: num_cached_tokens,
                             **{f"{ta.PREFIX_CACHE_HIT_TOKENS}.{source}": n for source, n in sources.items()}})
