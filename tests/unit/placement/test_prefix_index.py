"""The router's prefix index over a real block manager's KV events: it follows stores and evictions (through
gaps and restarts), matches the longest prefix per replica, and goes unknown past its staleness bound."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from pdserve.kv_events import EVICTED, STORED, KVEventBatch, KVEventLog
from pdserve.prefix_hash import prompt_block_hashes
from pdserve.sampling_params import SamplingParams
from pdserve.placement.prefix_index import PrefixIndex

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def compute(bm: BlockManager, tokens: list[int], request_id: str) -> Sequence:
    """A prefill on the pool: hit the cached prefix, cover the rest, cache the full blocks."""
    seq = Sequence(request_id, list(tokens), SamplingParams(), BS)
    bm.match_prefix(seq)
    assert bm.grow(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.register_full_blocks(seq)
    return seq


def sync(index: PrefixIndex, replica: str, log: KVEventLog) -> KVEventBatch:
    """One poll, through the wire form the worker sends."""
    batch = KVEventBatch.from_dict(log.read(index.cursor(replica)).to_dict())
    index.apply(replica, batch, layout_hash=7)
    return batch


def test_index_follows_stores_and_evictions_of_a_real_pool():
    bm = BlockManager(12, BS)
    clock = Clock()
    index = PrefixIndex(max_age_s=1.0, expect_s=0, clock=clock)
    system = list(range(100, 112))  # 3 full blocks shared by two prompts
    a = compute(bm, system + [1, 2, 3, 4, 5], "a")
    assert sync(index, "r0", bm.events).reset  # first read: the full set
    b = compute(bm, system + [9, 9, 9, 9, 9], "b")  # hits 3 blocks, stores 1 more
    batch = sync(index, "r0", bm.events)
    assert not batch.reset and [op for op, _ in batch.events] == [STORED]
    assert index.match("r0", prompt_block_hashes(system + [9] * 5 + [0], BS)) == 4
    assert index.match("r0", prompt_block_hashes(system + [1, 2, 3, 4, 5, 0], BS)) == 4
    bm.free(a)
    bm.free(b)
    compute(bm, list(range(500, 548)), "c")  # 12 fresh blocks: every cached block is reused
    batch = sync(index, "r0", bm.events)
    assert sum(op == EVICTED for op, _ in batch.events) == 5
    assert index.match("r0", prompt_block_hashes(system + [1, 2, 3, 4, 5, 0], BS)) == 0
    assert index.match("r0", prompt_block_hashes(list(range(500, 549)), BS)) == 12


def test_random_workload_index_equals_the_pool_through_gaps_and_restarts():
    rng = random.Random(0)
    bm = BlockManager(24, BS)
    bm.events = KVEventLog(capacity=16)  # small: long gaps between polls force resets
    index = PrefixIndex(max_age_s=1e9, expect_s=0)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((4, 8, 12)))] for _ in range(4)]
    live: list[Sequence] = []
    for step in range(400):
        if live and (rng.random() < 0.45 or bm.num_free_blocks < 8):
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
            live.append(compute(bm, tokens, f"s{step}"))
        if rng.random() < 0.3:
            sync(index, "r0", bm.events)
            assert set(index._entries["r0"].hashes) == set(bm.hash_to_block)
        if step == 200:  # the pool restarts (another epoch): the next read is a full set
            for seq in live:
                bm.free(seq)
            live = []
            bm = BlockManager(24, BS)
            assert sync(index, "r0", bm.events).reset
            assert not index._entries["r0"].hashes


def test_a_replica_goes_unknown_past_the_staleness_bound_and_back_on_the_next_read():
    clock = Clock()
    index = PrefixIndex(max_age_s=1.0, expect_s=0, clock=clock)
    log = KVEventLog()
    hashes = prompt_block_hashes(list(range(9)), BS)
    for h in hashes:
        log.stored(h)
    sync(index, "r0", log)
    assert index.match("r0", hashes) == 2 and index.layout_hash() == 7
    clock.now += 1.0
    assert index.match("r0", hashes) == 2  # at the bound: still fresh
    clock.now += 0.01
    assert index.held("r0") is None and index.match("r0", hashes) == 0 and index.layout_hash() is None
    sync(index, "r0", log)  # an empty batch is a successful read
    assert index.match("r0", hashes) == 2


def test_placed_blocks_count_until_their_events_settle_them_or_they_lapse():
    clock = Clock()
    index = PrefixIndex(max_age_s=100.0, expect_s=5.0, clock=clock)
    log = KVEventLog()
    sync(index, "r0", log)
    hashes = prompt_block_hashes(list(range(13)), BS)
    index.expect("r0", hashes)
    assert index.match("r0", hashes) == 3
    log.stored(hashes[0])
    log.evicted(hashes[1])  # settled: gone
    sync(index, "r0", log)
    assert index.match("r0", hashes) == 1
    index.expect("r0", hashes)
    clock.now += 5.01
    assert index.match("r0", hashes) == 1  # the expectation lapsed; the stored block stays


def test_log_read_after_a_cursor_and_resets_on_foreign_or_lost_cursors():
    log = KVEventLog(capacity=4)
    for h in (1, 2, 3):
        log.stored(h)
    log.evicted(2)
    full = log.read(None)
    assert full.reset and set(full.hashes) == {1, 3} and full.seq == 4
    log.stored(5)
    assert log.read((log.epoch, 4)).events == ((STORED, 5),)
    assert log.read((log.epoch, 5)).events == ()
    for h in range(10, 14):
        log.stored(h)
    assert log.read((log.epoch, 4)).reset  # older than the log keeps
    assert log.read(("another-epoch", 9)).reset
    assert log.read((log.epoch, "junk")).reset
    assert log.num_leading_held([1, 3, 5, 2, 10]) == 3


def test_a_batch_for_an_unknown_cursor_drops_the_entry_so_the_next_read_is_a_full_set():
    index = PrefixIndex()
    index.apply("r0", KVEventBatch("e1", 3, False, ((STORED, 1),)))
    assert index.cursor("r0") is None and index.held("r0") is None
    with pytest.raises(ValueError):
        KVEventBatch.from_dict({"epoch": "e", "seq": 1, "reset": False, "events": [(7, 1)]})
