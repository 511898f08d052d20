"""A handoff in parts over the local transport between two engines: parts staged while the prefill runs,
the tail imported after, and every way it can end without its tail (a lost part, a drop, a timeout, a late
part) leaving both pools whole."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from pdserve.api.contract import KVPart
from pdserve.engine import GenerationRequest
from pdserve.engine.kv_staging import StagedImports

from tests.unit.kvcache.test_local_handoff import GREEDY, NUM_BLOCKS, _collect, _engine, _free, _pair
from tests.unit.kvcache.test_local_handoff import tiny_dir  # noqa: F401  (the module's fixture)

PROMPT = tuple(range(40, 140))  # 100 tokens: 6 full blocks of 16 and a partial one
PART_TOKENS = 32


async def _prefill_in_parts(engine, exporter, request_id: str, prompt=PROMPT):
    """(parts exported as they came, first token, the final handoff), as the prefill deployment makes them."""
    request = GenerationRequest(request_id, prompt, GREEDY, prefill_only=True, kv_part_tokens=PART_TOKENS)
    parts = []
    async for delta in engine.generate(request):
        if delta.kv_part is not None:
            params = await exporter.export(delta.kv_part)
            parts.append(KVPart(dataclasses.replace(params, first_block=delta.kv_part.first_block), len(prompt)))
        else:
            return parts, delta.token_ids[0], delta.kv_handoff
    raise AssertionError("no final delta")


async def _end_exports(engine, exporter, parts, handoff) -> None:
    """What nobody pulled, prefill frees (the router aborts those leases)."""
    for lease_id in [p.params.lease_id for p in parts] + [handoff.lease_id]:
        exporter.transport.forget(lease_id)
        await engine.release_lease(lease_id)


def _whole(*engines) -> bool:
    return all(_free(e) == NUM_BLOCKS and not e.engine.leases.leases for e in engines)


@pytest.fixture
def engines(tiny_dir):  # noqa: F811
    return _engine(tiny_dir), _engine(tiny_dir), _engine(tiny_dir)


def test_parts_then_tail_decode_like_plain_generation(engines):
    async def main():
        a, b, ref = engines
        exporter, importer = _pair(a, b)
        staging = StagedImports(b, importer.transport)
        expected = await _collect(ref, GenerationRequest("ref", PROMPT, GREEDY))
        parts, first, handoff = await _prefill_in_parts(a, exporter, "p")
        assert [p.params.first_block for p in parts] == [0, 2, 4] and handoff.num_parted_blocks == 6
        tail = await exporter.export_tail(handoff)
        assert tail.first_block == 6 and len(tail.block_ids) == 1
        # the tail's call may come first: it waits for the parts
        waiting = asyncio.create_task(importer.import_tail(staging, "p", tail, timeout_s=10))
        for part in parts:
            assert await staging.stage("p", part)
        result = await waiting
        assert result.ok and result.num_parts == 3 and result.transfer_s > 0
        rest = await _collect(b, GenerationRequest("d", PROMPT, GREEDY, adopt_lease_id=result.lease_id,
                                                   first_token_id=first))
        assert [first, *rest] == expected
        assert _whole(a, b) and len(staging) == 0 and staging.num_parts_staged == 3
    asyncio.run(main())


@pytest.mark.parametrize("end", ["lost_part", "drop", "timeout", "late_part"])
def test_an_import_that_ends_without_its_tail_frees_both_pools(engines, end):
    async def main():
        a, b, _ = engines
        exporter, importer = _pair(a, b)
        staging = StagedImports(b, importer.transport)
        prompt = tuple((t * 7 + len(end)) % 250 for t in PROMPT)  # no prefix hit from another case
        parts, _, handoff = await _prefill_in_parts(a, exporter, f"p-{end}", prompt)
        assert len(parts) == 3
        tail = await exporter.export_tail(handoff)
        assert await staging.stage("r", parts[0])
        if end == "lost_part":  # its export is gone (prefill aborted it): the pull fails, the tail falls back
            exporter.transport.forget(parts[1].params.lease_id)
            await a.release_lease(parts[1].params.lease_id)
            assert not await staging.stage("r", parts[1])
            result = await importer.import_tail(staging, "r", tail, timeout_s=10)
            assert not result.ok and result.fallback_reason == "transfer_failed"
        elif end == "drop":  # its prefill or client went: the router drops what decode staged
            assert await staging.drop("r") and not await staging.drop("r")
            assert not await staging.stage("r", parts[1])  # a late part is refused
        elif end == "timeout":  # the parts never all come
            result = await importer.import_tail(staging, "r", tail, timeout_s=0.2)
            assert not result.ok and "missing" in result.error
        else:  # the tail ended it; a part arriving after is refused, not staged anew
            result = await importer.import_tail(staging, "r", dataclasses.replace(tail, first_block=2), timeout_s=1)
            assert not result.ok  # the tail does not fit the reservation from block 2: refused, released
            assert not await staging.stage("r", parts[1])
        for part in parts:  # what nobody pulled, prefill frees (the router aborts those leases)
            exporter.transport.forget(part.params.lease_id)
            await a.release_lease(part.params.lease_id)
        exporter.transport.forget(tail.lease_id)
        await a.release_lease(tail.lease_id)
        assert _whole(a, b) and len(staging) == 0
    asyncio.run(main())


def test_a_prefill_stream_closed_early_leaves_no_lease_behind(engines):
    """Parts the engine leased in deltas its consumer never read end with the stream (an early close: the
    prefill replica's caller gone), as does the request's own KV."""
    async def main():
        a, _, _ = engines
        request = GenerationRequest("early", PROMPT, GREEDY, prefill_only=True, kv_part_tokens=16)
        stream = a.generate(request)
        first = await anext(stream)
        assert first.kv_part is not None
        await asyncio.sleep(0.05)  # more steps run: their parts wait unread in the request's queue
        await stream.aclose()
        assert a.engine.leases.leases == {first.kv_part.lease_id: a.engine.leases.leases[first.kv_part.lease_id]}
        await a.release_lease(first.kv_part.lease_id)  # the part it did read is its reader's to end
        assert _whole(a)
    asyncio.run(main())


@pytest.mark.parametrize("order", ["drop_then_cancel", "cancel_then_drop"])
def test_a_part_cancelled_while_its_reservation_waits_leaves_no_lease(engines, order):
    """The router abandons a request (it cancels the part in flight and drops what decode staged) while the
    part still waits for its reservation (the engine's lock, held by a step): the reservation, granted
    afterwards, is released at once rather than at its lease's expiry, in either order of the two."""
    async def main():
        a, b, _ = engines
        exporter, importer = _pair(a, b)
        staging = StagedImports(b, importer.transport)
        parts, _, handoff = await _prefill_in_parts(a, exporter, f"p-{order}")
        async with b._lock:  # a step is running: the reservation waits
            staging_part = asyncio.create_task(staging.stage("r", parts[0]))
            await asyncio.sleep(0.01)
            assert not staging_part.done() and not b.engine.leases.leases
            if order == "drop_then_cancel":
                dropping = asyncio.create_task(staging.drop("r"))
                await asyncio.sleep(0.01)
                staging_part.cancel()
            else:
                staging_part.cancel()
                await asyncio.sleep(0.01)
                dropping = asyncio.create_task(staging.drop("r"))
                await asyncio.sleep(0.01)
        assert await dropping
        with pytest.raises(asyncio.CancelledError):
            await staging_part
        await asyncio.sleep(0.01)
        await _end_exports(a, exporter, parts, handoff)
        assert _whole(a, b) and len(staging) == 0
    asyncio.run(main())


def test_a_drop_cancelled_while_its_release_waits_still_releases(engines):
    """The router's drop is cancelled (its call cut) while the release waits for a step: it still happens."""
    async def main():
        a, b, _ = engines
        exporter, importer = _pair(a, b)
        staging = StagedImports(b, importer.transport)
        parts, _, handoff = await _prefill_in_parts(a, exporter, "p-cancelled-drop")
        assert await staging.stage("r", parts[0]) and b.engine.leases.leases
        async with b._lock:
            dropping = asyncio.create_task(staging.drop("r"))
            await asyncio.sleep(0.01)
            dropping.cancel()
            with pytest.raises(asyncio.CancelledError):
                await dropping
        await asyncio.sleep(0.01)
        await _end_exports(a, exporter, parts, handoff)
        assert _whole(a, b) and len(staging) == 0
    asyncio.run(main())
