"""AsyncLLMEngine on the tiny model: streaming, concurrency, stats snapshots, close, leases, batching
(aborts: test_async_engine_abort.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import AsyncLLMEngine, GenerationRequest, LLMEngine, TokenDelta
from pdserve.engine.outputs import EngineStats

from .conftest import MAX_TOKENS, NUM_BLOCKS, PROMPTS, SETTLE_S, collect, is_idle, make_engine, request, settle, tokens_of


def test_concurrent_generates_match_sequential(tiny_dir: Path) -> None:
    async def main() -> None:
        engine = make_engine(tiny_dir)
        try:
            cases = list(enumerate(zip(PROMPTS, MAX_TOKENS)))
            sequential = [await collect(engine, request(f"s{i}", p, n)) for i, (p, n) in cases]
            concurrent = await asyncio.gather(
                *(collect(engine, request(f"c{i}", p, n)) for i, (p, n) in cases)
            )
            for seq, con, n in zip(sequential, concurrent, MAX_TOKENS):
                assert tokens_of(con) == tokens_of(seq) and len(tokens_of(seq)) == n
                assert "".join(d.text for d in con) == "".join(d.text for d in seq)
                assert con[-1].finished and con[-1].finish_reason == "length"
            await settle(engine)
            assert engine.engine.clock.times  # it really stepped
        finally:
            await engine.close()

    asyncio.run(main())


def test_invalid_request_raises_on_first_iteration_and_holds_nothing(tiny_dir: Path) -> None:
    async def main() -> None:
        engine = make_engine(tiny_dir, max_model_len=32)
        try:
            with pytest.raises(ValueError):
                await collect(engine, request("long", b"x" * 30, max_tokens=8))
            with pytest.raises(ValueError):
                await collect(engine, GenerationRequest("oov", (1, 10_000)))
            assert is_idle(engine) and not engine._queues
            assert len(tokens_of(await collect(engine, request("ok", b"x" * 24, max_tokens=8)))) == 8
            await settle(engine)
        finally:
            await engine.close()

    asyncio.run(main())


def test_stats_snapshot_while_requests_run(tiny_dir: Path) -> None:
    async def main() -> None:
        engine = make_engine(tiny_dir, max_num_seqs=2)
        try:
            idle = engine.stats()
            assert (idle.num_waiting, idle.num_running, idle.queued_prefill_tokens) == (0, 0, 0)
            assert idle.num_free_blocks == idle.num_total_blocks == NUM_BLOCKS and idle.block_size == 16
            assert idle.recent_step_times_s == () == idle.recent_step_gaps_s and idle.num_leased_blocks == 0
            started = [asyncio.Event() for _ in range(2)]
            outs: list[list[TokenDelta]] = [[], [], []]

            async def consume(i: int, prompt: bytes, max_tokens: int) -> list[TokenDelta]:
                async for delta in engine.generate(request(f"st{i}", prompt, max_tokens=max_tokens)):
                    outs[i].append(delta)
                    if i < 2:
                        started[i].set()
                return outs[i]

            async def steps_later(n: int) -> None:
                target = len(outs[0]) + n
                while len(outs[0]) < target:
                    await asyncio.sleep(0.001)

            # two long-running requests fill max_num_seqs=2; they are aborted once the snapshot is checked
            tasks = [asyncio.create_task(consume(i, bytes([97 + i]) * (20 + i), 600)) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), SETTLE_S)
            tasks.append(asyncio.create_task(consume(2, b"w" * 37, 10)))
            await asyncio.sleep(0)
            await asyncio.wait_for(steps_later(2), SETTLE_S)  # the third is queued and two steps ran since
            snap = engine.stats()
            assert snap.num_running == 2 and snap.num_waiting == 1
            assert snap.queued_prefill_tokens == 37
            assert snap.num_total_blocks == NUM_BLOCKS and snap.num_free_blocks <= NUM_BLOCKS - 4
            assert snap.recent_step_times_s and all(t > 0 for t in snap.recent_step_times_s)
            assert len(snap.recent_step_tokens) == len(snap.recent_step_times_s)
            # a gap per step after the first while requests ran on
            assert 0 < len(snap.recent_step_gaps_s) and all(0 < g < SETTLE_S for g in snap.recent_step_gaps_s)
            assert snap.recent_step_tokens[-1] == 2  # two decodes a step while the third waits
            totals = snap.step_totals  # cumulative: every step so far (fewer than 32, so all are recent)
            assert totals.num_steps == len(snap.recent_step_times_s)
            assert totals.step_s == pytest.approx(sum(snap.recent_step_times_s))
            assert totals.num_gaps == len(snap.recent_step_gaps_s) and 0 < totals.step_cpu_s <= totals.step_s + 1e-3
            assert 1 <= totals.num_prefill_steps <= 2 < totals.num_steps  # the running two prefilled, the third waits
            assert snap.prefix_queried_tokens >= 41
            assert all(await asyncio.gather(engine.abort("st0"), engine.abort("st1")))
            await asyncio.wait_for(asyncio.gather(*tasks), SETTLE_S)
            assert [o[-1].finish_reason for o in outs] == ["abort", "abort", "length"]
            assert len(tokens_of(outs[2])) == 10
            await settle(engine)
            done = engine.stats()
            assert (done.num_waiting, done.num_running, done.queued_prefill_tokens) == (0, 0, 0)
            assert done.num_free_blocks == NUM_BLOCKS and done.num_leased_blocks == 0
        finally:
            await engine.close()

    asyncio.run(main())


def test_close_ends_open_streams(tiny_dir: Path) -> None:
    async def main() -> None:
        engine = make_engine(tiny_dir)
        got_one = asyncio.Event()
        received: list[TokenDelta] = []

        async def consume() -> None:
            async for delta in engine.generate(request("open", b"still streaming at close", max_tokens=500)):
                received.append(delta)
                got_one.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(got_one.wait(), SETTLE_S)
        await engine.close()
        await asyncio.wait_for(task, SETTLE_S)
        assert received[-1].finished and received[-1].finish_reason == "abort"
        assert is_idle(engine)

    asyncio.run(main())


def test_reserved_lease_expires_on_an_idle_engine(tiny_dir: Path) -> None:
    async def main() -> None:
        engine = AsyncLLMEngine(LLMEngine(EngineConfig(
            model=str(tiny_dir), device="cpu", dtype="float32", lease_ttl_s=0.0,
            cache=CacheConfig(num_blocks=NUM_BLOCKS, block_size=16),
        )))
        try:
            lease = await engine.reserve_kv(40)
            assert len(lease.block_ids) == 3 and engine.stats().num_leased_blocks == 3
            await settle(engine)  # nothing else runs: the loop itself must expire it
            assert not engine.engine.leases.leases
            assert not await engine.release_lease(lease.lease_id)
            assert engine.stats().num_free_blocks == NUM_BLOCKS
        finally:
            await engine.close()

    asyncio.run(main())


def test_a_stream_cancelled_before_it_adopts_its_lease_frees_the_leased_kv(tiny_dir: Path) -> None:
    """The window between a finished KV import and the engine adopting it: a client that leaves then
    must not leave the lease to its expiry."""
    import dataclasses

    async def main() -> None:
        engine = make_engine(tiny_dir)
        try:
            lease = await engine.reserve_kv(40)
            assert engine.stats().num_leased_blocks == 3
            adopt = dataclasses.replace(request("adopt", b"x" * 40), adopt_lease_id=lease.lease_id, first_token_id=7)
            async with engine._lock:  # the engine is busy (a step, an admission) when the adoption arrives
                stream = engine.generate(adopt)
                task = asyncio.create_task(anext(stream))
                await asyncio.sleep(0.05)
                task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert engine.stats().num_leased_blocks == 0 and not engine.engine.leases.leases
            await settle(engine)
            assert is_idle(engine)
        finally:
            await engine.close()

    asyncio.run(main())


def test_generate_batches_groups_what_the_consumer_missed(tiny_dir: Path) -> None:
    """A consumer that keeps up gets one delta per batch; one that lags gets fewer, larger batches holding
    the same deltas in order, the first batch at once; closing early aborts and frees every block."""

    async def main() -> tuple[list[int], list[list[TokenDelta]], list[list[TokenDelta]], EngineStats]:
        engine = make_engine(tiny_dir)
        try:
            reference = [t for d in await collect(engine, request("ref", b"batches", 24)) for t in d.token_ids]
            eager = [b async for b in engine.generate_batches(request("eager", b"batches", 24))]
            lagging = []
            async for batch in engine.generate_batches(request("lag", b"batches", 24)):
                lagging.append(batch)
                await asyncio.sleep(0.05)  # several steps go by
            stream = engine.generate_batches(request("early", b"batches", 24))
            await anext(stream)
            await stream.aclose()
            return reference, eager, lagging, engine.stats()
        finally:
            await engine.close()

    reference, eager, lagging, stats = asyncio.run(main())
    assert sum(len(b) == 1 for b in eager) >= 0.8 * len(eager)  # a busy machine may still hold one back
    assert [t for b in eager for d in b for t in d.token_ids] == reference
    assert len(lagging[0]) == 1 and len(lagging) < len(reference)
    assert [t for b in lagging for d in b for t in d.token_ids] == reference
    assert lagging[-1][-1].finished and not any(d.finished for b in lagging for d in b[:-1] if d is not b[-1])
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_requests_arriving_mid_step_count_as_waiting_before_the_step_ends(tiny_dir: Path) -> None:
    """A router polls stats while a step runs; a request placed here then waits for the step to end before
    the engine admits it, and the stats must show it meanwhile (else the router's view forgets it)."""
    import threading

    async def main() -> None:
        engine = make_engine(tiny_dir)
        held = threading.Event()
        try:
            started = asyncio.Event()

            async def long_running() -> None:
                async for _ in engine.generate(request("a0", b"a" * 20, max_tokens=400)):
                    started.set()

            running = asyncio.create_task(long_running())
            await asyncio.wait_for(started.wait(), SETTLE_S)
            # the worker thread waits on `held`: the loop's next step is in flight, with the lock held
            engine._executor.submit(held.wait, SETTLE_S)
            await asyncio.sleep(0.05)
            before = engine.stats()
            waiting = asyncio.create_task(collect(engine, request("b0", b"b" * 29, max_tokens=3)))
            gone = asyncio.create_task(collect(engine, request("c0", b"c" * 11, max_tokens=3)))
            await asyncio.sleep(0.05)
            mid = engine.stats()
            assert mid.num_waiting == before.num_waiting + 2
            assert mid.queued_prefill_tokens == before.queued_prefill_tokens + 29 + 11
            gone.cancel()  # its client left before admission: it no longer counts
            await asyncio.gather(gone, return_exceptions=True)
            after_cancel = engine.stats()
            assert after_cancel.num_waiting == before.num_waiting + 1
            assert after_cancel.queued_prefill_tokens == before.queued_prefill_tokens + 29
            held.set()
            out = await asyncio.wait_for(waiting, SETTLE_S)
            assert len(tokens_of(out)) == 3 and out[-1].finished
            assert await engine.abort("a0")
            await asyncio.wait_for(running, SETTLE_S)
            await settle(engine)
            done = engine.stats()
            assert (done.num_waiting, done.num_running, done.queued_prefill_tokens) == (0, 0, 0)
        finally:
            held.set()
            await engine.close()

    asyncio.run(main())
