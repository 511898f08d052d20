"""A request's event stream on its way out: the first event decides the HTTP status, the rest is SSE.

Events are (choice index, TokenBatch) pairs. Failures before the first event become a real
status (503 with Retry-After for full worker queues); after the 200 went out, an error travels as an
SSE chunk carrying `error`, followed by `[DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Send

from pdserve.api.contract import TokenBatch
from pdserve.api.tool_parser import ToolCallStream, ToolEvents
from pdserve.models.tokenizer import Tokenizer
from pdserve.streams import batches, merged
from pdserve.services.router import openai_api as oa
from pdserve.services.router.admission import Prepared
from pdserve.services.router.errors import APIError
from pdserve.worklink import WorkerOverloaded, WorkerUnavailable

Event = tuple[int, TokenBatch]
logger = logging.getLogger(__name__)


def upstream_error(exc: BaseException, retry_after_s: int) -> APIError:
    """An exception from a prefill or decode call, as the error the client sees: a stable message, a
    type and a code. What it says about the cluster (actor ids, pids, addresses, tracebacks) goes to
    the log only. A worker that is gone or full is a 503 with Retry-After, never a 500."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

    if isinstance(exc, APIError):
        return exc
    retry = {"Retry-After": str(max(1, retry_after_s))}
    if isinstance(exc, (BackPressureError, WorkerOverloaded)):
        return APIError(503, "worker queues are full; retry later", code="overloaded", reason="backpressure",
                        headers=retry)
    logger.warning("upstream failure: %s: %s", type(exc).__name__, exc, exc_info=exc)
    if isinstance(exc, (DeploymentUnavailableError, ReplicaUnavailableError, RayActorError, WorkerUnavailable)):
        return APIError(503, "a worker became unavailable; retry later", code="unavailable",
                        reason="unavailable", headers=retry)
    return APIError(500, "generation failed", code="internal_error", reason="internal_error")


async def first_event(events: AsyncIterator[Event], retry_after_s: int) -> Event | None:
    """Awaits the first event; on failure closes the stream (aborting its work) and raises APIError."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None
    except Exception as exc:
        await events.aclose()
        raise upstream_error(exc, retry_after_s) from None


class SSEResponse(StreamingResponse):
    """A streaming response that closes its body however the response ends. Starlette leaves a body
    that was suspended at a `yield` (the task cancelled inside `send`: a client gone mid-write) to the
    garbage collector, and until it runs decode keeps generating for nobody and the KV stays held."""

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled scope would cancel the close too
                await self.body_iterator.aclose()


def by_choice(batch: list[Event]) -> list[Event]:
    """A batch of events with each choice's joined into one, in the order choices first appear."""
    parts: dict[int, list[TokenBatch]] = {}
    for index, event in batch:
        parts.setdefault(index, []).append(event)
    return [(index, merged(events)) for index, events in parts.items()]


async def singles(events: AsyncIterator[Event]) -> AsyncIterator[list[Event]]:
    async for event in events:
        yield [event]


async def prepend(first: Event | None, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """`first` then the rest of `events`; closing this closes `events`."""
    try:
        if first is not None:
            yield first
        async for event in events:
            yield event
    finally:
        await events.aclose()


def tool_events(stream: ToolCallStream, event: TokenBatch) -> tuple[ToolEvents, str | None]:
    """A token batch's content and `delta.tool_calls`, and (when it ends the choice) the finish reason."""
    out = stream.feed(event.text)
    if not event.finished:
        return out, None
    last, finish = stream.finish(event.finish_reason)
    out.content += last.content
    for entry in last.calls:
        out.calls.append(entry)
    return out, finish


async def sse_stream(
    meta: oa.ResponseMeta, p: Prepared, events: AsyncIterator[Event], tokenizer: Tokenizer,
    interval_s: float | None = 0.0, on_write: Callable[[int], None] | None = None,
    on_end: Callable[[str], None] | None = None,
) -> AsyncIterator[bytes]:
    """`interval_s`: None writes each event on its own; 0 coalesces (a write per batch of what arrived
    meanwhile, the first at once); > 0 also caps writes at one per interval. `on_write(num_events)` counts;
    `on_end(status)` is told how the stream ended: "200", "error_after_first_token" when a failure
    after the 200 went out ended it, or "client_disconnected" when the client left first.
    Echoed prompt text (with logprobs, the prompt tokens' logprobs too) leads each choice's first chunk;
    with continuous usage every chunk carries the usage so far, and with include_usage a last chunk carries
    the total."""
    started = [False] * p.num_choices
    offsets = [0] * p.num_choices
    cached: list[int | None] = [None] * p.num_choices
    num_tokens = 0
    tool_streams = [ToolCallStream(p.tools) for _ in range(p.num_choices)] if p.tools is not None else None

    def encode(index: int, event: TokenBatch) -> bytes:
        nonlocal num_tokens
        num_tokens += len(event.token_ids)
        if cached[index] is None:
            cached[index] = event.num_cached_tokens
        text, lead, shown = event.text, None, None
        if not started[index] and p.echo_texts:
            echo = p.echo_of(index)
            if p.want_logprobs:
                lead = oa.echo_logprobs(tokenizer, p.echo_ids_of(index), event.prompt_logprobs,
                                        event.prompt_top_logprobs, echo)
            offsets[index] = len(echo)  # the generated tokens' offsets start after the echoed prompt
            shown = echo + text
        calls = None
        if tool_streams is not None:  # chat with tools: the text splits into content and calls
            calls, finish = tool_events(tool_streams[index], event)
            shown = calls.content
        part = oa.choice_chunk(meta, index, event, tokenizer, p.want_logprobs, offsets[index],
                               not started[index], lead, shown)
        if calls is not None:
            oa.add_tool_calls(part, calls, finish)
        started[index] = True
        offsets[index] += len(text)
        so_far = None
        if p.continuous_usage:
            so_far = oa.usage(p.num_prompt_tokens, num_tokens, oa.cached_tokens(cached, p.n))
        return oa.chunk(meta, [part], p.continuous_usage, so_far)

    # one write per batch: whatever events arrived while the previous write was on its way
    source = batches(events, interval_s) if interval_s is not None else singles(events)
    status = "200"
    try:
        async for batch in source:
            if on_write is not None:
                on_write(len(batch))
            yield b"".join(encode(index, event) for index, event in batch)
        if p.include_usage:
            yield oa.chunk(meta, [], True, oa.usage(p.num_prompt_tokens, num_tokens, oa.cached_tokens(cached, p.n)))
    except Exception as exc:  # the 200 went out already: the error travels in the stream
        status = "error_after_first_token"
        yield oa.sse(upstream_error(exc, 0).body())
    except (GeneratorExit, asyncio.CancelledError):  # the client left: the stream is closed under us
        status = "client_disconnected"
        raise
    finally:
        await source.aclose()  # first: a coalescing source reads `events` in a task of its own
        await events.aclose()
        if on_end is not None:
            on_end(status)
    yield oa.DONE
