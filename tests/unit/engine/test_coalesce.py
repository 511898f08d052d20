"""Coalesced streams: one item per batch for a consumer that keeps up, larger batches for one that lags,
errors in order, and closing the consumer closes the producer."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.api.contract import TokenBatch
from pdserve.streams import batches, merged
from pdserve.engine.outputs import TokenDelta


def _delta(k: int, **kw) -> TokenDelta:
    return TokenDelta("r", (k,), f"t{k}", logprobs=(-float(k),), top_logprobs=(((k, -1.0),),),
                      num_output_tokens=k + 1, **kw)


def test_merge_joins_tokens_text_logprobs_and_keeps_first_and_last_state():
    first = _delta(0, queue_time_s=0.5, num_cached_tokens=16, num_prefill_chunks=2)
    last = _delta(2, finished=True, finish_reason="stop", stop_reason="t2")
    one = merged([first, _delta(1), last])
    assert one.token_ids == (0, 1, 2) and one.text == "t0t1t2"
    assert one.logprobs == (0.0, -1.0, -2.0) and len(one.top_logprobs) == 3
    assert (one.finished, one.finish_reason, one.stop_reason) == (True, "stop", "t2")
    assert (one.queue_time_s, one.num_cached_tokens, one.num_prefill_chunks) == (0.5, 16, 2)
    assert one.num_output_tokens == 3
    assert merged([first]) is first


def test_merge_is_the_same_for_the_routers_token_batches():
    deltas = [_delta(0, num_cached_tokens=16, prompt_logprobs=(None, -0.5)), _delta(1),
              _delta(2, finished=True, finish_reason="length")]
    assert merged([TokenBatch.of(d) for d in deltas]) == TokenBatch.of(merged(deltas))
    plain = [TokenDelta("r", (k,), f"t{k}") for k in range(3)]
    assert merged(plain).logprobs is None and merged(plain).token_ids == (0, 1, 2)


async def _producer(n: int, gap_s: float, log: list[str], fail_at: int | None = None):
    try:
        for k in range(n):
            if k == fail_at:
                raise RuntimeError("upstream failed")
            log.append(f"put {k}")
            yield k
            await asyncio.sleep(gap_s)
    finally:
        log.append("closed")


def test_a_consumer_that_keeps_up_gets_one_item_per_batch():
    async def main():
        log: list[str] = []
        return [b async for b in batches(_producer(6, 0.01, log))], log

    got, log = asyncio.run(main())
    assert got == [[k] for k in range(6)] and log[-1] == "closed"


def test_a_lagging_consumer_gets_fewer_larger_batches_and_the_first_at_once():
    async def main():
        got = []
        async for batch in batches(_producer(20, 0.002, [])):
            got.append(batch)
            await asyncio.sleep(0.02)  # slower than the producer
        return got

    got = asyncio.run(main())
    assert got[0] == [0]
    assert [k for b in got for k in b] == list(range(20))
    assert len(got) < 20 and max(len(b) for b in got) > 1


def test_an_error_arrives_after_the_items_before_it():
    async def main():
        seen = []
        with pytest.raises(RuntimeError, match="upstream failed"):
            async for batch in batches(_producer(5, 0.0, [], fail_at=3)):
                seen.extend(batch)
        return seen

    assert asyncio.run(main()) == [0, 1, 2]


def test_closing_the_consumer_closes_the_producer():
    async def main():
        log: list[str] = []
        stream = batches(_producer(1000, 0.01, log))
        assert await anext(stream) == [0]
        await stream.aclose()
        await asyncio.sleep(0.05)
        return log

    log = asyncio.run(main())
    assert log[-1] == "closed" and len(log) < 10


def test_interval_caps_the_batch_rate():
    async def main():
        return [b async for b in batches(_producer(10, 0.002, []), interval_s=0.5)]

    got = asyncio.run(main())
    assert got[0] == [0] and [k for b in got for k in b] == list(range(10))
    assert len(got) <= 3  # ~20 ms of items after the first, at most one batch per 500 ms
