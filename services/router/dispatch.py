"""How the router runs one admitted request: n choices per prompt, each a prefill call and a decode stream
(or a decode stream alone), on the replicas placement chose for its prompt; closing the stream aborts
everywhere."""

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import logging

from opentelemetry import trace
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from pdserve.observability import trace_attributes as ta
from pdserve.api.contract import FallbackNotice, KVPart, PrefillResult, TokenBatch, WorkerRequest, resumed
from pdserve.services.router import openai_api as oa
from pdserve.services.router.admission import Prepared
from pdserve.services.router.kv_parts import PartSender
from pdserve.placement.policy import Placement
from pdserve.worklink import WorkerUnavailable


logger = logging.getLogger(__name__)
# a worker replica that died, or a deployment with none left: retried elsewhere when nothing was sent yet
WORKER_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, WorkerUnavailable)


class DispatchMixin:
    """RouterDeployment's request execution; uses its `workers` (services.router.workers), telemetry,
    metrics, _enter/_exit and _background."""

    def _abort_lease(self, replica: str | None, lease_id: str, parts: PartSender | None = None) -> None:
        """Frees a prefill lease nobody will pull, on the replica that holds it, and the leases of the parts
        that went ahead of it (those decode pulled are gone already), and what decode staged of them."""
        self._spawn(self.workers.abort(replica, lease_id))
        if parts is not None:
            self._abort_parts(replica, parts)

    def _abort_parts(self, replica: str | None, parts: PartSender) -> None:
        parts.abandon()
        for lease_id in parts.lease_ids:
            self._spawn(self.workers.abort(replica, lease_id))

    def _in_parts(self, request: WorkerRequest) -> bool:
        """Whether the prompt's KV goes to decode in parts while it is prefilled (kv_part_tokens)."""
        size = self.config.kv_part_tokens
        return size is not None and len(request.prompt_token_ids) > size

    async def _prefill_in_parts(self, request: WorkerRequest, parts: PartSender) -> PrefillResult | None:
        """`_prefill`, streaming: each KVPart goes on to decode as it comes. Shielded like `_prefill`: a caller
        cancelled meanwhile lets the stream run to its result, then frees every lease it offered and what
        decode staged. None when the prefill replica is gone."""
        call = asyncio.ensure_future(self._stream_prefill(request, parts))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(lambda done: self._release_orphan_parts(done, parts))
            raise

    def _release_orphan_parts(self, call: asyncio.Future, parts: PartSender) -> None:
        result = None if call.cancelled() or call.exception() is not None else call.result()
        if result is not None and result.handoff is not None:
            self._abort_lease(result.replica, result.handoff.lease_id, parts)
        elif result is not None:
            self._abort_parts(result.replica, parts)
        else:
            parts.abandon()

    async def _stream_prefill(self, request: WorkerRequest, parts: PartSender) -> PrefillResult | None:
        request = dataclasses.replace(request, kv_part_tokens=self.config.kv_part_tokens)
        stream = self.workers.prefill_stream(request)
        result = None
        try:
            async for event in stream:
                if isinstance(event, KVPart):
                    parts.send(event)
                else:
                    result = event
            if result is None:
                raise RuntimeError("the prefill stream ended without its result")
            return result
        except WORKER_GONE as exc:
            if result is not None:  # gone after it answered: its lease is lost with it, decode falls back
                return result
            return self._prefill_lost(request, exc)
        finally:
            if result is None:
                stream.cancel()

    async def _merged(
        self, request_id: str, p: Prepared, placements: list[Placement], span, meta: oa.ResponseMeta
    ) -> AsyncIterator[tuple[int, TokenBatch]]:
        """(choice index, token batch) from the request's choices (placements: one per prompt); closing it cancels
        them all (engines abort, KV frees).
        Ends the request's span and records its TTFT/TPOT/E2E and SLO outcome (not for client aborts)."""
        start = time.monotonic()
        ttft = None
        num_tokens = [0] * p.num_choices
        finish_reasons: list[str] = []
        outcome = None  # True: finished, False: failed; None: the client went away
        carrier = self.telemetry.tracing.inject(span)
        self._enter()  # here, not at admission: a stream closed before its first step never ran this body
        try:
            async for index, event in self._choices(request_id, p, placements, carrier, span):
                count = len(event.token_ids)
                if ttft is None and count:
                    ttft = time.monotonic() - start
                    span.add_event(ta.EVENT_FIRST_TOKEN)
                num_tokens[index] += count
                if event.finished:
                    finish_reasons.append(event.finish_reason or "")
                yield index, event
            outcome = True
        except Exception as exc:
            outcome = False
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._exit()
            self.placer.done(request_id)
            if outcome is None and len(finish_reasons) >= p.num_choices:
                outcome = True  # every choice finished; the consumer closed this before it ran to its end
            total = sum(num_tokens)
            self.metrics.add_generation_tokens(total)
            if outcome is not None:
                self.metrics.record_request(ok=outcome, ttft_s=ttft, e2e_s=time.monotonic() - start,
                                            output_tokens=max(num_tokens))
            if span.is_recording():
                span.set_attributes(ta.response_attributes(
                    response_id=meta.id, model=meta.model, input_tokens=p.num_prompt_tokens,
                    output_tokens=total, finish_reasons=finish_reasons or ["abort"]))
            span.end()

    async def _choices(
        self, request_id: str, p: Prepared, placements: list[Placement], carrier: dict[str, str], span
    ) -> AsyncIterator[tuple[int, TokenBatch]]:
        if p.num_choices == 1:
            async with aclosing(self._run_one(request_id, p.prompts[0], p.params, placements[0], carrier, span)) as one:
                async for event in one:
                    yield 0, event
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                k = p.prompt_of(i)
                one = self._run_one(f"{request_id}-{i}", p.prompts[k], p.params_for(i), placements[k], carrier, span)
                async with aclosing(one):
                    async for event in one:
                        queue.put_nowait((i, event))
                queue.put_nowait((i, None))
            except Exception as exc:
                queue.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(p.num_choices)]
        try:
            remaining = p.num_choices
            while remaining:
                i, event = await queue.get()
                if event is None:
                    remaining -= 1
                    continue
                if isinstance(event, Exception):
                    raise event
                yield i, event
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_one(
        self, request_id: str, prompt_ids: tuple[int, ...], params, placement: Placement, carrier: dict[str, str],
        span,
    ) -> AsyncIterator[TokenBatch]:
        """One choice's token batches. The request names the replica placement chose (None: Serve's choice),
        which PlacementRequestRouter honours. A decode replica lost mid-stream is replaced (`_migrate`)."""
        request = WorkerRequest(request_id, prompt_ids, params, placement.priority, placement.prefill_chunk_tokens,
                                carrier, prefix_pull_blocks=placement.prefix_pull_blocks)
        first = handoff = stream = parts = None
        finished = imported = False
        sent: list[int] = []  # token ids the client has, in order; token j took the seeded stream's j-th draw
        try:
            # parts need a named decode replica: Serve's own choice would scatter them over the pool
            if placement.disaggregate and placement.decode_replica is not None and self._in_parts(request):
                parts = PartSender(self.workers, request.to(placement.decode_replica), WORKER_GONE, self._spawn)
                first = await self._prefill_in_parts(request.to(placement.prefill_replica), parts)
                if first is None or first.handoff is None or first.handoff.first_block == 0:
                    parts.abandon()  # nothing for decode to finish: its staged parts go
            elif placement.disaggregate:
                first = await self._prefill(request.to(placement.prefill_replica))
            if first is not None:
                handoff = first.handoff
                if first.first.finished or handoff is None:
                    finished = handoff is None
                    if parts is not None:
                        self._abort_parts(first.replica, parts)
                    yield dataclasses.replace(first.first, finished=True)
                    return
                # prefill delivered the prompt logprobs: decode (a fallback included) must not compute them again
                decode = dataclasses.replace(request.to(placement.decode_replica),
                                             params=dataclasses.replace(params, prompt_logprobs=None))
                stream = self.workers.generate(decode, handoff, first.first.token_ids[0])
                sent.extend(first.first.token_ids)
                yield first.first
            else:
                stream = self.workers.generate(request.to(placement.decode_replica))
            replica, num_migrations = placement.decode_replica, 0
            while True:
                try:
                    async for event in stream:
                        if isinstance(event, FallbackNotice):  # counted and traced by decode (its series say why)
                            if handoff is not None:  # decode prefills locally: nobody will pull the lease now
                                self._abort_lease(first.replica, handoff.lease_id, parts)
                                handoff = None
                            continue
                        imported = True
                        finished = event.finished
                        sent.extend(event.token_ids)
                        yield event
                    break
                except WORKER_GONE as exc:
                    if num_migrations >= self.config.max_migrations:
                        raise
                    if handoff is not None and not imported:
                        self._abort_lease(first.replica, handoff.lease_id, parts)
                    handoff, num_migrations = None, num_migrations + 1
                    replica, stream = await self._migrate(request, replica, sent, num_migrations, exc, span)
        finally:
            if not finished:
                if stream is not None:
                    stream.cancel()
                if handoff is not None and not imported:
                    # decode never confirmed the pull: the prefill lease would otherwise wait for its TTL
                    self._abort_lease(first.replica, handoff.lease_id, parts)
                if parts is not None and first is None:  # gone during the prefill: its stream freed its leases
                    parts.abandon()

    async def _migrate(
        self, request: WorkerRequest, dead: str | None, sent: list[int], attempt: int, exc: BaseException, span,
    ) -> tuple[str, Any]:
        """The stream of `request` continued on another live decode replica after `dead` failed: the
        prompt plus every token the client has, the rest of its token budget, and its seeded draws
        skipped (`rng_offset`), so a seeded stream goes on as it would have. Waits up to
        `migration_timeout_s` for a replica that answered after the failure; re-raises `exc` if none does."""
        failed_at = time.monotonic()
        if dead is not None:
            self.workers.forget("decode", dead)
        deadline = failed_at + self.config.migration_timeout_s
        while True:
            live = [s for s in self.workers.live("decode") if s.replica != dead and s.received_at > failed_at]
            if live:
                break
            if time.monotonic() >= deadline:
                logger.warning("no decode replica to migrate %s to: %s", request.request_id, exc)
                raise exc
            await asyncio.sleep(self.placer.config.stats_poll_period_s)
        target = min(live, key=lambda s: s.stats.get("num_running", 0) + s.stats.get("num_waiting", 0)).replica
        moved = dataclasses.replace(resumed(request, sent), request_id=f"{request.request_id}-m{attempt}",
                                    replica=target, prefix_pull_blocks=0)
        logger.warning("decode replica %s failed mid-stream (%s: %s); %s continues on %s after %d tokens",
                       dead, type(exc).__name__, exc, request.request_id, target, len(sent))
        self.api_metrics.count_migration("decode_unavailable")
        span.add_event(ta.EVENT_MIGRATION, {"pdserve.migration.from": dead or "", "pdserve.migration.to": target,
                                            "pdserve.migration.tokens_sent": len(sent)})
        return target, self.workers.generate(moved)

    async def _prefill(self, request: WorkerRequest) -> PrefillResult | None:
        """The prefill call, shielded: a caller cancelled while it runs (a client gone while other choices
        already stream) lets it finish and frees its lease, which nobody would pull. None when the prefill
        replica is gone (killed, crashed, none left): the decode replica then prefills locally, counted
        as a `prefill_unavailable` fallback, since nothing was sent to the client yet."""
        call = asyncio.ensure_future(self._await(self.workers.prefill(request)))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(self._release_orphan)
            raise
        except WORKER_GONE as exc:
            return self._prefill_lost(request, exc)

    def _prefill_lost(self, request: WorkerRequest, exc: BaseException) -> None:
        """The prefill replica is gone before it answered: counted, and decode prefills locally."""
        logger.warning("prefill for %s failed, decode prefills locally: %s: %s", request.request_id,
                       type(exc).__name__, exc)
        if request.replica is not None:
            self.workers.forget("prefill", request.replica)
        self.metrics.count_fallback("prefill_unavailable")

    @staticmethod
    async def _await(response) -> Any:
        return await response

    def _release_orphan(self, call: asyncio.Future) -> None:
        if call.cancelled() or call.exception() is not None:
            return
        result = call.result()
        if result.handoff is not None:
            self._abort_lease(result.replica, result.handoff.lease_id)

    def _spawn(self, response) -> None:
        async def wait() -> None:
            try:
                await response
            except Exception:
                pass

        task = asyncio.get_running_loop().create_task(wait())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

def prediction_attributes(placement: Placement) -> dict[str, Any]:
    out: dict[str, Any] = {"pdserve.placement.meets_slo": placement.meets_slo}
    if placement.predicted_ttft_s is not None:
        out["pdserve.placement.predicted_ttft_s"] = placement.predicted_ttft_s
    if placement.predicted_tpot_s is not None:
        out["pdserve.placement.predicted_tpot_s"] = placement.predicted_tpot_s
    if placement.prefix_hit_tokens or placement.prefix_pull_blocks:
        out["pdserve.placement.prefix_hit_tokens"] = placement.prefix_hit_tokens
        out["pdserve.placement.prefix_pull_blocks"] = placement.prefix_pull_blocks
    if placement.prefill_chunk_tokens is not None:
        out["pdserve.placement.prefill_chunk_tokens"] = placement.prefill_chunk_tokens
    if placement.candidates:
        out["pdserve.placement.candidates"] = [f"{c.role}:{c.replica_id}:{c.metric}={c.predicted_s:.4f}"
                                               for c in placement.candidates]
    return out
