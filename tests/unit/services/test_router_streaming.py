"""The router's stream plumbing: the first event decides the status; later errors travel as SSE chunks."""

from __future__ import annotations

import asyncio
import json

import pytest
from ray.exceptions import RayActorError
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError
from pdserve.sampling_params import SamplingParams
from pdserve.services.router import openai_api as oa
from pdserve.services.router.admission import Prepared
from pdserve.services.router.errors import APIError
from pdserve.api.contract import Priority, TokenBatch
from pdserve.services.router.streaming import first_event, prepend, sse_stream, upstream_error
from ray.serve.exceptions import BackPressureError


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("latin-1")


class Events:
    """An async iterator of events that raises `fail` after them, and records being closed."""

    def __init__(self, events, fail=None):
        self.events, self.fail, self.closed = list(events), fail, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.events:
            return self.events.pop(0)
        if self.fail is not None:
            raise self.fail
        raise StopAsyncIteration

    async def aclose(self):
        self.closed = True


def _prepared(include_usage=False):
    return Prepared(False, ((1, 2, 3),), SamplingParams(max_tokens=4), 1, True, include_usage, False, 2.0, 0.2, Priority.INTERACTIVE)


def _event(text, finished=False):
    return 0, TokenBatch((ord(text),), text, finished, "length" if finished else None)


async def _collect(agen):
    return [part async for part in agen]


def _sse_events(writes: list[bytes]) -> list[bytes]:
    """The SSE events in a stream's writes (a coalesced write holds several)."""
    return [event + b"\n\n" for event in b"".join(writes).split(b"\n\n") if event]


def test_error_after_first_token_is_an_sse_chunk_then_done():
    events = Events([_event("a"), _event("b")], fail=RuntimeError("decode replica died"))
    meta = oa.ResponseMeta("cmpl-1", "tiny", False)
    ended: list[str] = []
    stream = sse_stream(meta, _prepared(), events, ByteTokenizer(), on_end=ended.append)
    parts = _sse_events(asyncio.run(_collect(stream)))
    assert parts[-1] == oa.DONE and events.closed
    assert ended == ["error_after_first_token"]  # counted apart from the streams that ended well
    ended.clear()
    asyncio.run(_collect(sse_stream(meta, _prepared(), Events([_event("a", True)]), ByteTokenizer(), on_end=ended.append)))
    assert ended == ["200"]
    bodies = [json.loads(p[6:]) for p in parts[:-1]]
    assert [b["choices"][0]["text"] for b in bodies[:2]] == ["a", "b"]
    error = bodies[2]["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] == "generation failed" and error["type"] == "internal_error"  # the cause: in the log


def test_usage_chunk_counts_tokens():
    events = Events([_event("a"), _event("b", finished=True)])
    meta = oa.ResponseMeta("cmpl-2", "tiny", False)
    parts = _sse_events(asyncio.run(_collect(sse_stream(meta, _prepared(include_usage=True), events, ByteTokenizer()))))
    usage = json.loads(parts[-2][6:])["usage"]
    assert usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                     "prompt_tokens_details": {"cached_tokens": 0}}


def test_backpressure_before_first_event_is_503_with_retry_after_and_closes_stream():
    events = Events([], fail=BackPressureError(num_queued_requests=3, max_queued_requests=3))
    with pytest.raises(APIError) as info:
        asyncio.run(first_event(events, retry_after_s=2))
    assert info.value.status == 503 and info.value.headers == {"Retry-After": "2"}
    assert info.value.reason == "backpressure" and events.closed


def test_other_failures_map_to_500_and_api_errors_pass_through():
    assert upstream_error(ValueError("boom"), 1).status == 500
    given = APIError(429, "slow down")
    assert upstream_error(given, 1) is given


INTERNALS = "ray::ServeReplica:pdserve:decode (pid=4242, ip=10.1.2.3, actor_id=88ca505fd7c7a67b7a63c6cf01000000)"


@pytest.mark.parametrize("exc,status", [
    (RuntimeError(INTERNALS), 500),
    (RayActorError(error_msg=INTERNALS), 503),
    (DeploymentUnavailableError(DeploymentID(name="decode", app_name="pdserve")), 503),
])
def test_upstream_failures_never_show_internals(exc, status):
    """Actor ids, pids, addresses and tracebacks go to the log; the client gets a stable message and a
    code, and a worker that is gone is a 503 with Retry-After, never a 500."""
    err = upstream_error(exc, 0)
    body = json.dumps(err.body())
    assert err.status == status and err.body()["error"]["code"] in ("internal_error", "unavailable")
    for leak in ("pid=", "4242", "10.1.2.3", "actor_id", "ServeReplica", "Traceback", "decode"):
        assert leak not in body
    assert (err.headers.get("Retry-After") == "1") == (status == 503)


def test_prepend_replays_first_and_closes_source():
    events = Events([_event("b")])
    out = asyncio.run(_collect(prepend(_event("a"), events)))
    assert [e[1].text for e in out] == ["a", "b"] and events.closed
    empty = Events([])
    assert asyncio.run(_collect(prepend(None, empty))) == [] and empty.closed


def test_a_lagging_writer_sends_fewer_larger_writes_with_the_same_events():
    async def produce():
        for k in range(30):
            yield _event(chr(ord("a") + k % 26))
            await asyncio.sleep(0.002)

    meta = oa.ResponseMeta("cmpl-3", "tiny", False)

    async def consume(interval_s):
        writes = []
        stream = sse_stream(meta, _prepared(), produce(), ByteTokenizer(), interval_s, writes.append)
        parts = []
        async for part in stream:
            parts.append(part)
            await asyncio.sleep(0.02)  # the proxy (or client) takes longer than a token
        return writes, parts

    coalesced, parts = asyncio.run(consume(0.0))
    singles, plain = asyncio.run(consume(None))
    assert b"".join(parts) == b"".join(plain)  # the same bytes, in fewer writes
    assert sum(coalesced) == sum(singles) == 30 and singles == [1] * 30
    assert coalesced[0] == 1 and len(coalesced) < 30


def test_a_client_that_leaves_mid_stream_is_counted_as_disconnected():
    """Closing the stream (what Starlette does when the client goes) is neither a 200 nor an error."""
    meta = oa.ResponseMeta("cmpl-1", "tiny", False)
    ended: list[str] = []

    async def main():
        events = Events([_event("a"), _event("b"), _event("c", True)])
        stream = sse_stream(meta, _prepared(), events, ByteTokenizer(), interval_s=None, on_end=ended.append)
        await stream.__anext__()
        await stream.aclose()
        return events

    events = asyncio.run(main())
    assert ended == ["client_disconnected"] and events.closed


@pytest.mark.parametrize("spec_version", ["2.0", "2.4"])  # Starlette's two paths: a task group or a plain await
def test_a_response_cancelled_inside_send_closes_its_stream_at_once(spec_version):
    """The client leaves while a write is on its way: the task is cancelled in `send`, with the SSE
    stream suspended at its `yield`. Its events (decode's call) must close then, not at the next GC."""
    from starlette.responses import StreamingResponse

    from pdserve.services.router.streaming import SSEResponse

    meta = oa.ResponseMeta("cmpl-4", "tiny", False)

    async def run(response_type) -> tuple[bool, list[str]]:
        """Whether the events were closed, and how the stream ended, before the loop shuts down (asyncio.run
        closes what is left of every async generator then)."""
        events, ended = Events([_event("a"), _event("b"), _event("c", True)]), []
        response = response_type(sse_stream(meta, _prepared(), events, ByteTokenizer(), None, on_end=ended.append))
        in_send, never = asyncio.Event(), asyncio.Event()

        async def send(message):
            if message.get("body"):
                in_send.set()
                await never.wait()  # the write that the client never takes

        async def receive():
            await never.wait()

        scope = {"type": "http", "asgi": {"spec_version": spec_version}}
        task = asyncio.create_task(response(scope, receive, send))
        await in_send.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.05)
        return events.closed, list(ended)

    closed, ended = asyncio.run(run(lambda body: StreamingResponse(body, media_type="text/event-stream")))
    assert not closed and ended == []  # Starlette's own: left for the garbage collector
    closed, ended = asyncio.run(run(SSEResponse))
    assert closed and ended == ["client_disconnected"]
