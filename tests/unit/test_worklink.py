"""pdserve.worklink: the codec round-trips the contract exactly and refuses malformed bytes; a real
link server and client on loopback carry calls, cancellation, overload, failures and a dead peer, and
the framing refuses what breaks it."""

from __future__ import annotations

import asyncio
import dataclasses
from contextlib import asynccontextmanager

import msgpack
import pytest

from pdserve.api.contract import FallbackNotice, HandoffParams, KVPart, PrefillResult, Priority, TokenBatch, WorkerRequest
from pdserve.sampling_params import SamplingParams
from pdserve.worklink import (CodecError, Link, LinkClient, LinkServer, WorkerLinkError, WorkerOverloaded,
                              WorkerUnavailable, codec)
from pdserve.worklink.frames import HEADER, MAX_FRAME_BYTES, MAX_HELLO_BYTES, Kind, frame

REQUEST = WorkerRequest("r-1", (5, 6, 7), SamplingParams(max_tokens=9, temperature=0.7, seed=11, stop=("x", "yz"),
                                                          stop_token_ids=(3,), logprobs=2,
                                                          logit_bias=((4, -1.5),)),
                        Priority.BATCH, 32, {"traceparent": "00-ab-cd-01"}, "replica-a", prefix_pull_blocks=2,
                        rng_offset=3, num_resumed_tokens=1, kv_part_tokens=64)
HANDOFF = HandoffParams("ucx", 1234567, "lease-1", 20, (4, 9), (1 << 60,), "127.0.0.1", 40000)
BATCH = TokenBatch((8, 9), "ab", True, "stop", "yz", (-0.25, -1.0), (((8, -0.25), (1, -2.0)), ((9, -1.0),)),
                   3, 2, 1, (None, -0.5, -3.0), (None, ((6, -0.5),), ((7, -3.0),)))


def test_codec_round_trips_every_message():
    defaults = WorkerRequest("d", (1,), SamplingParams())
    unset = [f for f in codec.REQUEST_FIELDS if getattr(REQUEST, f) == getattr(defaults, f)]
    assert unset == [], f"set these in REQUEST so the round trip covers them: {unset}"
    assert codec.unpack_call(codec.pack_call(REQUEST)) == (REQUEST, None, None)
    assert codec.unpack_call(codec.pack_call(REQUEST, HANDOFF, 42)) == (REQUEST, HANDOFF, 42)
    result = PrefillResult(BATCH, HANDOFF, "replica-p")
    assert codec.unpack_result(codec.pack_result(result)) == result
    assert codec.unpack_result(codec.pack_result(PrefillResult(BATCH, None, "p"))).handoff is None
    assert codec.unpack_event(codec.pack_event(BATCH)) == BATCH
    assert codec.unpack_event(codec.pack_event(TokenBatch((1,), "a"))) == TokenBatch((1,), "a")
    notice = FallbackNotice("import_failed", "peer gone")
    assert codec.unpack_event(codec.pack_event(notice)) == notice
    part = KVPart(dataclasses.replace(HANDOFF, first_block=4), 100)
    assert codec.unpack_prefill_event(codec.pack_prefill_event(part)) == part
    assert codec.unpack_prefill_event(codec.pack_prefill_event(result)) == result


@pytest.mark.parametrize("data", [
    b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb(("a",) * 9), msgpack.packb([2, "x", None]),
    codec.pack_call(REQUEST)[:-3],
])
def test_codec_refuses_malformed_bytes(data):
    for unpack in (codec.unpack_call, codec.unpack_result, codec.unpack_event, codec.unpack_prefill_event):
        with pytest.raises(CodecError):
            unpack(data)


def test_codec_refuses_invalid_values():
    values, handoff, first = msgpack.unpackb(codec.pack_call(REQUEST), use_list=False)
    for name, value in (("prompt_token_ids", ()), ("params", {"max_tokens": -1}), ("params", {"no_such": 1}),
                        ("priority", 7), ("prefix_pull_blocks", -1)):
        bad = list(values)
        bad[codec.REQUEST_FIELDS.index(name)] = value
        with pytest.raises(CodecError):
            codec.unpack_call(msgpack.packb((bad, handoff, first)))


class Worker:
    """A worker whose calls the tests steer: what they saw, when they were closed."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()
        self.seen: list = []
        self.release = asyncio.Event()

    async def prefill(self, request: WorkerRequest) -> PrefillResult:
        self.seen.append(request)
        if request.request_id == "boom":
            raise RuntimeError("secret internals at 10.1.2.3 pid=77")
        if request.request_id == "slow":
            await self.release.wait()
        return PrefillResult(BATCH, HANDOFF, "replica-p")

    async def generate(self, request, handoff, first):
        self.seen.append((request, handoff, first))
        try:
            yield FallbackNotice("import_failed")
            for i in range(request.params.max_tokens):
                yield TokenBatch((i,), str(i), finished=i == request.params.max_tokens - 1)
                if request.request_id == "slow":
                    await self.release.wait()
        finally:
            self.closed.set()

    async def abort(self, lease_id: str) -> bool:
        return lease_id == "lease-1"

    async def prefill_stream(self, request: WorkerRequest):
        for k in range(2):
            yield KVPart(dataclasses.replace(HANDOFF, first_block=2 * k), 50)
        yield PrefillResult(BATCH, dataclasses.replace(HANDOFF, first_block=4), "replica-p")

    async def kv_part(self, request: WorkerRequest, part: KVPart) -> bool:
        self.seen.append((request, part))
        return part.params.first_block == 0

    async def stats(self, want_events: bool, cursor):
        self.seen.append(("stats", want_events, cursor))
        reply = {"num_running": 2, "recent_step_times_s": (0.004, 0.005), "replica": "replica-p"}
        if want_events:
            reply["kv_events"] = {"epoch": "e", "seq": 7, "reset": cursor is None, "events": [(1, 1 << 63)],
                                  "hashes": [1 << 63]}
        return reply


@asynccontextmanager
async def _linked(ongoing: int = 8, queued: int = 8):
    """(worker, server, link, client) on loopback; the client closed and the server stopped after."""
    worker = Worker()
    server = LinkServer("the-token", prefill=worker.prefill, generate=worker.generate, abort=worker.abort,
                        stats=worker.stats, prefill_stream=worker.prefill_stream, kv_part=worker.kv_part,
                        max_ongoing=ongoing, max_queued=queued)
    address = await server.start("127.0.0.1")
    client = LinkClient()
    try:
        yield worker, server, Link(address, "the-token"), client
    finally:
        await client.close()
        await server.stop()


def test_link_carries_prefill_decode_and_abort():
    async def main():
        async with _linked() as (worker, server, link, client):
            assert await client.prefill(link, REQUEST) == PrefillResult(BATCH, HANDOFF, "replica-p")
            events = [e async for e in client.generate(link, REQUEST, HANDOFF, 42)]
            assert events[0] == FallbackNotice("import_failed")
            assert [e.token_ids for e in events[1:]] == [(i,) for i in range(9)] and events[-1].finished
            assert worker.seen[-1] == (REQUEST, HANDOFF, 42)
            assert await client.abort(link, "lease-1") and not await client.abort(link, "other")
    asyncio.run(main())


def test_link_carries_a_prefill_in_parts_and_the_parts_to_decode():
    async def main():
        async with _linked() as (worker, server, link, client):
            events = [e async for e in client.prefill_stream(link, REQUEST)]
            assert [e.params.first_block for e in events[:2]] == [0, 2] and all(e.num_prompt_tokens == 50
                                                                                for e in events[:2])
            assert events[2] == PrefillResult(BATCH, dataclasses.replace(HANDOFF, first_block=4), "replica-p")
            assert await client.kv_part(link, REQUEST, events[0]) and not await client.kv_part(link, REQUEST, events[1])
            assert worker.seen[-1] == (REQUEST, events[1])
            assert await client.prefill(link, REQUEST) == PrefillResult(BATCH, HANDOFF, "replica-p")  # connection reused
    asyncio.run(main())


def test_stats_polls_carry_stats_and_kv_events_and_are_never_queued():
    async def main():
        async with _linked(ongoing=1, queued=0) as (worker, server, link, client):
            assert await client.stats(link) == {"num_running": 2, "recent_step_times_s": (0.004, 0.005),
                                                "replica": "replica-p"}
            assert worker.seen[-1] == ("stats", False, None)
            reply = await client.stats(link, True, ("e", 3))
            assert worker.seen[-1] == ("stats", True, ("e", 3))
            assert reply["kv_events"]["events"] == ((1, 1 << 63),) and not reply["kv_events"]["reset"]
            assert (await client.stats(link, True))["kv_events"]["reset"]
            slow = asyncio.ensure_future(client.prefill(link, WorkerRequest("slow", (1,), SamplingParams())))
            while server.num_in_flight == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(WorkerOverloaded):  # the one call slot is taken and nothing may queue ...
                await client.prefill(link, REQUEST)
            assert (await client.stats(link))["num_running"] == 2  # ... but a stats poll still answers
            worker.release.set()
            await slow
            for bad in (b"\x92\x01\x02", msgpack.packb((True, ("e", 1, 2))), msgpack.packb(("yes", None))):
                with pytest.raises(ValueError):  # INVALID_ARGUMENT
                    await client.unary(link, Kind.STATS, bad)
    asyncio.run(main())


def test_a_worker_without_stats_refuses_the_call_and_a_stranger_gets_nothing():
    async def main():
        server = LinkServer("the-token", prefill=Worker().prefill)
        link = Link(await server.start("127.0.0.1"), "the-token")
        client = LinkClient()
        try:
            with pytest.raises(ValueError, match="no stats calls"):
                await client.stats(link)
            with pytest.raises(WorkerLinkError, match="UNAUTHENTICATED"):
                await client.stats(Link(link.address, "guessed"))
        finally:
            await client.close()
            await server.stop()
    asyncio.run(main())


def test_codec_refuses_malformed_stats_replies():
    for data in (msgpack.packb([1, 2]), msgpack.packb({1: "x"}), b"\xc1"):
        with pytest.raises(CodecError):
            codec.unpack_stats(data)


def test_cancelling_a_stream_closes_the_worker_side():
    async def main():
        async with _linked() as (worker, server, link, client):
            stream = client.generate(link, WorkerRequest("slow", (1,), SamplingParams(max_tokens=50)))
            it = aiter(stream)
            await anext(it)
            await anext(it)
            stream.cancel()
            await asyncio.wait_for(worker.closed.wait(), 5)
            assert server.num_in_flight == 0
    asyncio.run(main())


def test_failures_map_to_link_errors_without_internals():
    async def main():
        async with _linked(ongoing=1, queued=1) as (worker, server, link, client):
            with pytest.raises(WorkerLinkError) as failed:
                await client.prefill(link, WorkerRequest("boom", (1,), SamplingParams()))
            assert not isinstance(failed.value, WorkerUnavailable)
            assert "10.1.2.3" not in str(failed.value) and "pid" not in str(failed.value)
            slow = asyncio.ensure_future(client.prefill(link, WorkerRequest("slow", (1,), SamplingParams())))
            while server.num_in_flight == 0:
                await asyncio.sleep(0.01)
            queued = asyncio.ensure_future(client.prefill(link, REQUEST))  # waits for the slot
            while server.num_queued == 0:
                await asyncio.sleep(0.01)
            with pytest.raises(WorkerOverloaded):
                await client.prefill(link, REQUEST)
            worker.release.set()
            assert (await slow).replica == "replica-p" and (await queued).replica == "replica-p"
            assert server.num_in_flight == server.num_queued == 0
            with pytest.raises(ValueError):  # bytes the worker cannot decode: INVALID_ARGUMENT
                await client.unary(link, Kind.PREFILL, b"\x93\x01\x02\x03")
            assert (await client.prefill(link, REQUEST)).replica == "replica-p"  # the connection still serves
    asyncio.run(main())


def test_a_dead_worker_is_unavailable():
    async def main():
        async with _linked() as (worker, server, link, client):
            await server.stop()
            with pytest.raises(WorkerUnavailable):
                await client.prefill(link, REQUEST)
            with pytest.raises(WorkerUnavailable):
                async for _ in client.generate(link, REQUEST):
                    pass
    asyncio.run(main())


def test_a_call_without_the_token_is_refused():
    async def main():
        async with _linked() as (worker, server, link, client):
            intruder = LinkClient()
            wrong = Link(link.address, "guessed")
            try:
                for call in (intruder.prefill(wrong, REQUEST), intruder.abort(wrong, "lease-1"),
                             anext(aiter(intruder.generate(wrong, REQUEST)))):
                    with pytest.raises(WorkerLinkError) as refused:
                        await call
                    assert "UNAUTHENTICATED" in str(refused.value)
                assert worker.seen == []
                with pytest.raises(ValueError):
                    LinkServer("", prefill=worker.prefill)
            finally:
                await intruder.close()
    asyncio.run(main())


def test_calls_reuse_pooled_connections_and_a_cut_call_closes_its_own():
    async def main():
        async with _linked() as (worker, server, link, client):
            for _ in range(3):
                await client.prefill(link, REQUEST)
                assert [e async for e in client.generate(link, REQUEST)][-1].finished
            assert len(server.connections) == 1
            worker.closed.clear()
            stream = client.generate(link, WorkerRequest("slow", (1,), SamplingParams(max_tokens=50)))
            it = aiter(stream)
            await anext(it)
            await it.aclose()  # the router stopped reading: the worker side ends too
            await asyncio.wait_for(worker.closed.wait(), 5)
            while server.num_in_flight:  # released as the cancelled call unwinds
                await asyncio.sleep(0.01)
            assert (await client.prefill(link, REQUEST)).replica == "replica-p"
    asyncio.run(main())


def test_a_stopping_worker_refuses_new_calls_as_unavailable_and_lets_running_ones_end():
    async def main():
        async with _linked() as (worker, server, link, client):
            # two pooled connections: the slow call takes one, the stop leaves the other open during its grace
            await asyncio.gather(client.prefill(link, REQUEST), client.prefill(link, REQUEST))
            assert len(server.connections) == 2
            slow = asyncio.ensure_future(client.prefill(link, WorkerRequest("slow", (1,), SamplingParams())))
            while server.num_in_flight == 0:
                await asyncio.sleep(0.01)
            stopping = asyncio.ensure_future(server.stop(grace_s=5))
            await asyncio.sleep(0.05)
            with pytest.raises(WorkerUnavailable, match="shutting down"):
                await client.prefill(link, REQUEST)
            worker.release.set()
            assert (await slow).replica == "replica-p"
            await stopping
    asyncio.run(main())


def test_a_worker_that_stops_mid_stream_is_unavailable():
    async def main():
        async with _linked() as (worker, server, link, client):
            it = aiter(client.generate(link, WorkerRequest("slow", (1,), SamplingParams(max_tokens=50))))
            await anext(it)
            await server.stop()
            with pytest.raises(WorkerUnavailable):
                while True:
                    await anext(it)
            assert worker.closed.is_set()
    asyncio.run(main())


@pytest.mark.parametrize("data", [
    frame(Kind.HELLO, b"the-token") + HEADER.pack(MAX_FRAME_BYTES + 1, Kind.PREFILL),  # over the size limit
    HEADER.pack(MAX_HELLO_BYTES + 1, Kind.HELLO),  # a large frame before the token was checked
    frame(99),  # no such kind
    frame(Kind.HELLO, b"the-token") + frame(Kind.HELLO, b"the-token"),  # HELLO twice
    frame(Kind.HELLO, b"the-token") + frame(Kind.DATA, b"x"),  # a worker's frame from the client
])
def test_a_connection_that_breaks_the_framing_is_closed(data):
    async def main():
        async with _linked() as (worker, server, link, client):
            host, port = link.host_port
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(data)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing answered
            writer.close()
            assert worker.seen == [] and server.num_in_flight == 0
    asyncio.run(main())
