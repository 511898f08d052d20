"""Ray Serve prefill deployment: prompt -> first token + handoff params (KV stays leased until pulled)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from ray import serve
from ray.serve import Application

from pdserve.api.contract import HandoffParams, KVPart, PrefillEvent, PrefillResult, TokenBatch, WorkerRequest
from pdserve.engine.outputs import GenerationRequest
from pdserve.observability import trace_attributes as ta
from pdserve.services.replica_router import ROUTER_CLASS_PATH
from pdserve.services.worker_endpoints import WorkerEndpoints
from pdserve.observability.telemetry import Telemetry
from pdserve.services.worker import WorkerConfig, build_transport, start_engine
from pdserve.worklink import LinkServer

if TYPE_CHECKING:
    from pdserve.engine.async_engine import AsyncLLMEngine


@serve.deployment(name="prefill")
class PrefillDeployment(WorkerEndpoints):
    def __init__(self, config: dict[str, Any], engine: AsyncLLMEngine | None = None) -> None:
        # the engine's modules load torch here, in the replica: the driver imports this module only to bind
        from pdserve.engine.handoff import KVExporter
        from pdserve.engine.prefix_pull import PrefixPuller

        self.config = WorkerConfig.model_validate(config)
        self.engine = engine or start_engine(self.config, "prefill")
        self.transport = build_transport(self.config, self.engine)
        self.exporter = KVExporter(self.engine, self.transport)
        self.prefix_puller = PrefixPuller.over(self.engine, self.transport)
        self.telemetry = Telemetry("prefill", self.config.model, self.config.tracing_env)
        self._started = False

    async def _start(self) -> None:
        if not self._started:
            await self.transport.start()
            self._started = True

    async def prefill(self, request: WorkerRequest) -> PrefillResult:
        """Prompt -> first token + the handoff of all its KV (parts are for `prefill_stream`)."""
        async with aclosing(self.prefill_stream(dataclasses.replace(request, kv_part_tokens=None))) as events:
            async for event in events:
                result = event
        return result

    async def prefill_stream(self, request: WorkerRequest) -> AsyncIterator[PrefillEvent]:
        """With `request.kv_part_tokens`, a KVPart for each part of the prompt's KV as soon as it is computed
        (exported under its own lease), then the PrefillResult, whose handoff holds only the blocks after the
        parts. Closed before its end (the router gone, the client gone), it frees every lease it exported."""
        await self._start()
        self.count_arrival(len(request.prompt_token_ids))
        gen = GenerationRequest(request.request_id, request.prompt_token_ids, request.params, prefill_only=True,
                                priority=request.priority, max_prefill_chunk=request.max_prefill_chunk,
                                kv_part_tokens=request.kv_part_tokens)
        start = time.monotonic()
        metrics = self.telemetry.metrics
        exported: list[str] = []  # leases this call exported: freed here unless it ends normally
        done = False
        try:
            with self.telemetry.tracing.span(ta.SPAN_PREFILL, context=self.telemetry.parent(request.trace),
                                             attributes={ta.PREFILL_REPLICA: self.telemetry.replica}) as span:
                pull = await self.pull_prefix(request, span)
                async with aclosing(self.engine.generate(gen)) as deltas:
                    async for delta in deltas:
                        if delta.kv_part is None:
                            break
                        exported.append(delta.kv_part.lease_id)
                        params = await self.exporter.export(delta.kv_part)
                        yield KVPart(dataclasses.replace(params, first_block=delta.kv_part.first_block),
                                     delta.num_prompt_tokens)
                elapsed = time.monotonic() - start
                queue = delta.queue_time_s or 0.0
                span.set_attributes({
                    ta.QUEUE_SECONDS: queue, ta.PREFILL_CHUNKS: delta.num_prefill_chunks,
                    ta.PROMPT_TOKENS: delta.num_prompt_tokens, ta.KV_TRANSPORT: self.config.transport,
                    "pdserve.prefill.kv_parts": len(exported),
                })
                metrics.observe_queue(queue)
                metrics.observe_prefill(elapsed - queue)
                metrics.add_prompt_tokens(delta.num_prompt_tokens)
                self.count_prefix_hits(pull, delta.num_cached_tokens, span)
                handoff: HandoffParams | None = None
                if delta.kv_handoff is not None:
                    exported.append(delta.kv_handoff.lease_id)
                    handoff = await self.exporter.export_tail(delta.kv_handoff)
                    span.set_attribute(ta.KV_BLOCKS, len(delta.kv_handoff.block_ids))
            # the engine ends a prefill-only request at its first token; the request itself ends only on a reason
            first = dataclasses.replace(TokenBatch.of(delta), finished=delta.finish_reason is not None)
            done = True
            yield PrefillResult(first, handoff, self.telemetry.replica)
        finally:
            if not done:  # cancelled (client gone) or failed: nobody will pull these leases
                for lease_id in exported:
                    await asyncio.shield(self.abort(lease_id))  # a second cancel must not skip one

    def link_server(self) -> LinkServer:
        return LinkServer(self.link_token, prefill=self.prefill, prefill_stream=self.prefill_stream, abort=self.abort, stats=self.link_stats,
                          max_ongoing=self.config.max_ongoing_requests, max_queued=self.config.max_queued_requests)

    async def abort(self, lease_id: str) -> bool:
        """Drop an export whose decode side will never pull it (client gone before transfer)."""
        forget = getattr(self.transport, "forget", None)
        if forget is not None:
            forget(lease_id)
        return await self.engine.release_lease(lease_id)


def build_app(config: WorkerConfig | dict[str, Any]) -> Application:
    cfg = config if isinstance(config, WorkerConfig) else WorkerConfig.model_validate(config)
    return PrefillDeployment.options(**cfg.deployment_options(ROUTER_CLASS_PATH)).bind(cfg.model_dump())
