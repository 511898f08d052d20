"""Ray Serve decode deployment: import a request's KV, adopt it, stream tokens; fall back to local prefill."""

from __future__ import annotations

import dataclasses
import time
from contextlib import aclosing
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from ray import serve
from ray.serve import Application

from pdserve.api.contract import DecodeEvent, FallbackNotice, HandoffParams, KVPart, TokenBatch, WorkerRequest, resumed
from pdserve.engine.outputs import GenerationRequest
from pdserve.observability import trace_attributes as ta
from pdserve.services.replica_router import ROUTER_CLASS_PATH
from pdserve.services.worker_endpoints import WorkerEndpoints
from pdserve.streams import merged
from pdserve.observability.telemetry import Telemetry
from pdserve.services.worker import WorkerConfig, build_transport, start_engine
from pdserve.worklink import LinkServer

if TYPE_CHECKING:
    from pdserve.engine.async_engine import AsyncLLMEngine


@serve.deployment(name="decode")
class DecodeDeployment(WorkerEndpoints):
    def __init__(self, config: dict[str, Any], engine: AsyncLLMEngine | None = None) -> None:
        # the engine's modules load torch here, in the replica: the driver imports this module only to bind
        from pdserve.engine.handoff import KVImporter, engine_layout
        from pdserve.engine.kv_staging import StagedImports
        from pdserve.engine.prefix_pull import PrefixPuller

        self.config = WorkerConfig.model_validate(config)
        self.engine = engine or start_engine(self.config, "decode")
        self.transport = build_transport(self.config, self.engine)
        self.importer = KVImporter(self.engine, self.transport)
        self.staging = StagedImports(self.engine, self.transport, max_age_s=2 * self.config.lease_ttl_s)
        self.prefix_puller = PrefixPuller.over(self.engine, self.transport)
        self.telemetry = Telemetry("decode", self.config.model, self.config.tracing_env)
        self.block_nbytes = engine_layout(self.engine).block_nbytes

    async def generate(
        self, request: WorkerRequest, handoff: HandoffParams | None = None, first_token_id: int | None = None
    ) -> AsyncIterator[DecodeEvent]:
        """Streams token batches. With a handoff the first token came from prefill and is not repeated.
        A failed import is announced by a FallbackNotice (never silent) and this worker prefills
        locally, continuing from the prompt plus prefill's first token, so the stream stays consistent
        (those batches then count the first token in num_prompt_tokens)."""
        prompt = request.prompt_token_ids
        self.count_arrival(len(prompt))
        gen = GenerationRequest(request.request_id, prompt, request.params, priority=request.priority,
                                max_prefill_chunk=request.max_prefill_chunk, rng_offset=request.rng_offset,
                                num_resumed_tokens=request.num_resumed_tokens)
        tracing, metrics = self.telemetry.tracing, self.telemetry.metrics
        start = time.monotonic()
        span = tracing.start_span(ta.SPAN_DECODE, context=self.telemetry.parent(request.trace),
                                  attributes={ta.DECODE_REPLICA: self.telemetry.replica})
        num_tokens = 0
        spec_counts = (0, 0, 0)  # drafted, accepted, verification steps: cumulative on every delta
        pull = None  # the Redis tier's part of a local prefill's prefix
        if request.request_id in self.staging.staged and (handoff is None or not handoff.first_block):
            await self.staging.drop(request.request_id)  # its prefill failed: this call prefills locally
        try:
            if handoff is not None:
                if first_token_id is None:
                    raise ValueError("a handoff needs the first token prefill produced")
                gen, fallback = await self._import(gen, handoff, first_token_id, span, self._misrouted(request))
                if fallback is not None:
                    yield fallback
                    pull = await self.pull_prefix(request, span)
            else:
                metrics.add_prompt_tokens(len(prompt))
                pull = await self.pull_prefix(request, span)
            coalesce = self.config.stream_coalesce  # off: one message per engine delta
            stream = self.engine.generate_batches(gen, self.config.stream_interval_ms / 1e3 if coalesce else 0.0)
            async with aclosing(stream) as batches:  # closed at once when the caller goes: the engine aborts
                async for batch in batches:
                    for delta in ([merged(batch)] if coalesce and len(batch) > 1 else batch):
                        if num_tokens == 0:
                            queue = delta.queue_time_s or 0.0
                            metrics.observe_queue(queue)
                            self.count_prefix_hits(pull, delta.num_cached_tokens, span)
                            span.set_attributes({ta.QUEUE_SECONDS: queue, ta.PREFILL_CHUNKS: delta.num_prefill_chunks,
                                                 "pdserve.decode.first_step_seconds": time.monotonic() - start})
                        num_tokens += len(delta.token_ids)
                        self.count_output(len(delta.token_ids))
                        spec_counts = (delta.num_draft_tokens, delta.num_accepted_tokens, delta.num_verifications)
                        yield TokenBatch.of(delta)
        finally:
            metrics.observe_decode(time.monotonic() - start)
            metrics.add_generation_tokens(num_tokens)
            if spec_counts[2]:
                metrics.observe_speculation(*spec_counts)
                span.set_attributes(ta.speculation_attributes(*spec_counts))
            span.set_attribute("pdserve.decode.tokens", num_tokens)
            span.end()

    def _misrouted(self, request: WorkerRequest) -> bool:
        """Serve sent a call named for another replica here (that one is gone): none of its parts are here."""
        return request.replica is not None and request.replica != self.telemetry.replica

    async def _import(
        self, gen: GenerationRequest, params: HandoffParams, first_token_id: int, span, misrouted: bool = False
    ) -> tuple[GenerationRequest, FallbackNotice | None]:
        """The request adopting the pulled KV, or, on a failed import, one that prefills locally and
        continues from the prompt plus prefill's first token, so the stream stays consistent (its events
        then count that token in num_prompt_tokens), with the notice for the router. A fallback is never
        silent: it is counted, traced, and announced. The local request keeps its placement fields."""
        num_blocks = params.first_block + len(params.block_ids)
        nbytes = num_blocks * self.block_nbytes
        attributes = {ta.KV_TRANSPORT: params.transport, ta.KV_BLOCKS: num_blocks, ta.KV_BYTES: nbytes}
        start = time.monotonic()
        with self.telemetry.tracing.span(ta.SPAN_KV_TRANSFER, context=trace.set_span_in_context(span),
                                         attributes=attributes) as kv_span:
            if params.first_block and misrouted:
                result = self.importer.fallback("transfer_failed", "the parts went to the replica this call was for")
            elif params.first_block:  # the leading blocks came as parts while prefill ran
                result = await self.importer.import_tail(self.staging, gen.request_id, params,
                                                         self.config.lease_ttl_s)
            else:
                result = await self.importer.import_kv(params)
            exposed = time.monotonic() - start
            # labelled by the path the bytes took: a same-host pull through shared memory is "shm", not "ucx"
            transport = result.path or params.transport
            transfer = exposed if result.transfer_s is None else result.transfer_s
            kv_span.set_attributes({ta.KV_TRANSPORT: transport, ta.KV_PARTS: result.num_parts,
                                    ta.KV_EXPOSED_SECONDS: exposed, ta.KV_TRANSFER_SECONDS: transfer})
            if not result.ok:
                kv_span.set_attribute(ta.FALLBACK_REASON, result.fallback_reason)
        if result.ok:
            self.telemetry.metrics.observe_kv_transfer(transfer, nbytes, transport, exposed_s=exposed)
            return dataclasses.replace(gen, adopt_lease_id=result.lease_id, first_token_id=first_token_id), None
        self.telemetry.metrics.count_fallback(result.fallback_reason)
        span.set_attribute(ta.FALLBACK_REASON, result.fallback_reason)
        span.add_event(ta.EVENT_FALLBACK, {ta.FALLBACK_REASON: result.fallback_reason, "error": result.error or ""})
        return resumed(gen, (first_token_id,)), FallbackNotice(result.fallback_reason, result.error)

    async def kv_part(self, request: WorkerRequest, part: KVPart) -> bool:
        """Pulls a part of `request`'s KV, sent while its prefill still runs, into the reservation for its
        prompt; False once that import failed (its tail then falls back)."""
        if self._misrouted(request):
            return False  # the earlier parts are on the replica it was for: the router drops them there
        return await self.staging.stage(request.request_id, part)

    async def drop_staged(self, request: WorkerRequest | str) -> bool:
        """Frees the parts staged for a request whose tail will never come (its prefill or client gone)."""
        return await self.staging.drop(request if isinstance(request, str) else request.request_id)

    def link_server(self) -> LinkServer:
        return LinkServer(self.link_token, generate=self.generate, kv_part=self.kv_part, abort=self.drop_staged,
                          stats=self.link_stats,
                          max_ongoing=self.config.max_ongoing_requests, max_queued=self.config.max_queued_requests)

    async def fallbacks(self) -> dict[str, int]:
        return dict(self.importer.fallbacks)


def build_app(config: WorkerConfig | dict[str, Any]) -> Application:
    cfg = config if isinstance(config, WorkerConfig) else WorkerConfig.model_validate(config)
    return DecodeDeployment.options(**cfg.deployment_options(ROUTER_CLASS_PATH)).bind(cfg.model_dump())
