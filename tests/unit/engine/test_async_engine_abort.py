"""AsyncLLMEngine on the tiny model: aborts from every side (before the first token, a consumer that
breaks out or is cancelled, from outside, at random points) leak no request, block or queue."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from pathlib import Path

import pytest

from pdserve.engine import TokenDelta

from .conftest import NUM_BLOCKS, SETTLE_S, collect, make_engine, request, settle, tokens_of


def test_abort_before_the_first_token(tiny_dir: Path) -> None:
    async def main() -> None:
        # a long prompt in 16-token chunks takes several steps before its first token
        engine = make_engine(tiny_dir, max_num_batched_tokens=16, max_num_seqs=4)
        try:
            agen = engine.generate(request("early", b"y" * 200, max_tokens=8))
            first = asyncio.ensure_future(agen.__anext__())
            await asyncio.sleep(0)
            seq = engine.engine.requests["early"].seq
            # admitted, not yet stepped (the loop task runs after us): the snapshot already shows it
            snap = engine.stats()
            assert (snap.num_waiting, snap.queued_prefill_tokens, snap.recent_step_times_s) == (1, 200, ())
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            await settle(engine)
            assert seq.finish_reason == "abort" and seq.num_output_tokens == 0
            assert engine.engine.scheduler.num_waiting == engine.engine.scheduler.num_running == 0
        finally:
            await engine.close()

    asyncio.run(main())


def test_abort_by_breaking_out_of_the_stream(tiny_dir: Path) -> None:
    async def main() -> None:
        engine = make_engine(tiny_dir)
        try:
            other = asyncio.create_task(collect(engine, request("other", b"keeps going", max_tokens=20)))
            received = []
            async for delta in engine.generate(request("brk", b"break out of me", max_tokens=200)):
                received.append(delta)
                seq = engine.engine.requests["brk"].seq
                if len(received) == 3:
                    break
            assert not received[-1].finished
            done = await other  # the other stream is not disturbed
            assert len(tokens_of(done)) == 20 and done[-1].finish_reason == "length"
            await settle(engine)
            assert seq.finish_reason == "abort"  # stopped, not left to run to max_tokens
        finally:
            await engine.close()

    asyncio.run(main())


def test_abort_by_cancelling_the_consumer_task(tiny_dir: Path) -> None:
    async def main() -> None:
        engine = make_engine(tiny_dir)
        try:
            got_two = asyncio.Event()
            received: list[TokenDelta] = []
            seqs = []

            async def consume() -> None:
                async for delta in engine.generate(request("cancel-me", b"cancel this one", max_tokens=200)):
                    received.append(delta)
                    if len(received) == 2:
                        seqs.append(engine.engine.requests["cancel-me"].seq)
                        got_two.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(got_two.wait(), SETTLE_S)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await settle(engine)
            assert not any(d.finished for d in received)
            assert seqs[0].finish_reason == "abort"
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_stream_cancelled_again_while_its_abort_waits_still_aborts(tiny_dir: Path) -> None:
    """A consumer that closes the stream and is then cancelled while the abort waits for a step to end
    (the worker link: it closes the stream when its connection is closing, then the connection's loss
    cancels the call). The request used to keep decoding for nobody until max_tokens."""

    async def main() -> None:
        engine = make_engine(tiny_dir)
        try:
            first = asyncio.Event()

            async def consume() -> None:
                async with aclosing(engine.generate_batches(request("twice", b"cancel me twice", 400))) as batches:
                    async for _ in batches:
                        first.set()
                        await asyncio.sleep(3600)

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), SETTLE_S)
            seq = engine.engine.requests["twice"].seq
            async with engine._lock:  # a step in flight: the abort must wait for it
                task.cancel()  # the stream is closed: its abort now waits for the lock
                for _ in range(5):
                    await asyncio.sleep(0)
                task.cancel()  # and the consumer is cancelled again
                with pytest.raises(asyncio.CancelledError):
                    await task
            await settle(engine)
            assert seq.finish_reason == "abort"  # not "length": it did not run on to max_tokens
        finally:
            await engine.close()

    asyncio.run(main())


def test_abort_from_outside_ends_the_stream(tiny_dir: Path) -> None:
    async def main() -> None:
        engine = make_engine(tiny_dir)
        try:
            received: list[TokenDelta] = []
            got_one = asyncio.Event()

            async def consume() -> None:
                async for delta in engine.generate(request("ext", b"aborted by the server", max_tokens=200)):
                    received.append(delta)
                    got_one.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(got_one.wait(), SETTLE_S)
            assert await engine.abort("ext")
            snap = engine.stats()  # taken by the abort itself, no step since
            assert snap.num_running == snap.num_waiting == 0 and snap.num_free_blocks == NUM_BLOCKS
            await asyncio.wait_for(task, SETTLE_S)  # the consumer is told, it does not hang
            assert received[-1].finished and received[-1].finish_reason == "abort"
            assert not await engine.abort("ext")
            await settle(engine)
        finally:
            await engine.close()

    asyncio.run(main())


def test_many_aborts_at_random_points_leak_nothing(tiny_dir: Path) -> None:
    async def main() -> None:
        engine = make_engine(tiny_dir, max_num_batched_tokens=64, max_num_seqs=4)
        try:
            seqs = {}

            async def consume(i: int) -> int:
                n = 0
                prompt = bytes([65 + i]) * (10 + 7 * i)
                async for _ in engine.generate(request(f"m{i}", prompt, max_tokens=400)):
                    seqs[i] = engine.engine.requests[f"m{i}"].seq
                    n += 1
                    if n == i % 4 + 1:
                        break
                return n

            tasks = [asyncio.create_task(consume(i)) for i in range(8)]
            await asyncio.sleep(0.05)
            tasks[7].cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert isinstance(results[7], asyncio.CancelledError) or results[7] == 4
            await settle(engine)
            assert engine.stats().num_free_blocks == NUM_BLOCKS
            assert all(seq.finish_reason == "abort" for seq in seqs.values()) and len(seqs) >= 7
        finally:
            await engine.close()

    asyncio.run(main())
