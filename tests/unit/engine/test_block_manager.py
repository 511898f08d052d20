from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdserve.engine.block_manager import BlockManager, block_hash
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams

BS = 4


def make_seq(tokens: list[int], block_size: int = BS, request_id: str = "r") -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(), block_size)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """What a prefill does to the pool: cover the tokens, mark them computed, cache the full blocks."""
    num_tokens = len(seq) if num_tokens is None else num_tokens
    assert bm.grow(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    bm.register_full_blocks(seq)


def chained_hashes(tokens: list[int], num_blocks: int) -> list[int]:
    hashes, parent = [], None
    for i in range(num_blocks):
        parent = block_hash(parent, tokens[i * BS : (i + 1) * BS])
        hashes.append(parent)
    return hashes


# --- allocation and refcounts --------------------------------------------------------------------


def test_allocate_and_release_restore_free_count():
    bm = BlockManager(8, BS)
    ids = bm.allocate_blocks(3)
    assert len(set(ids)) == 3
    assert bm.num_free_blocks == 5
    assert all(bm.blocks[i].ref_count == 1 for i in ids)
    assert bm.usage == pytest.approx(3 / 8)
    bm.release_blocks(ids)
    assert bm.num_free_blocks == 8
    assert all(bm.blocks[i].ref_count == 0 for i in ids)


def test_allocate_more_than_free_raises_without_taking_any():
    bm = BlockManager(4, BS)
    bm.allocate_blocks(3)
    assert not bm.can_allocate(2)
    with pytest.raises(MemoryError):
        bm.allocate_blocks(2)
    assert bm.num_free_blocks == 1


def test_double_free_raises():
    bm = BlockManager(4, BS)
    ids = bm.allocate_blocks(2)
    bm.release_blocks(ids)
    with pytest.raises(RuntimeError, match="double free"):
        bm.release_blocks(ids[:1])
    with pytest.raises(RuntimeError, match="double free"):
        bm.release_blocks([3])  # never allocated
    assert bm.num_free_blocks == 4


def test_free_sequence_releases_its_table_and_clears_it():
    bm = BlockManager(8, BS)
    seq = make_seq(list(range(10)))
    compute(bm, seq)
    assert len(seq.block_table) == 3 and len(seq.block_hashes) == 2
    bm.free(seq)
    assert seq.block_table == [] and seq.block_hashes == []
    assert bm.num_free_blocks == 8
    bm.free(seq)  # an empty table frees nothing
    assert bm.num_free_blocks == 8


def test_shared_prefix_block_is_refcounted():
    bm = BlockManager(8, BS)
    a = make_seq(list(range(9)), request_id="a")
    compute(bm, a)
    b = make_seq(list(range(8)) + [99, 98], request_id="b")
    assert bm.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in b.block_table] == [1, 1]
    assert bm.num_free_blocks == 6
    bm.free(b)
    assert bm.num_free_blocks == 8


def test_grow_covers_tokens_and_fails_without_change_when_short():
    bm = BlockManager(4, BS)
    seq = make_seq(list(range(20)))
    assert bm.num_blocks_to_grow(seq, 5) == 2
    assert bm.grow(seq, 5)
    assert len(seq.block_table) == 2
    assert bm.grow(seq, 8)  # already covered
    assert len(seq.block_table) == 2
    table = list(seq.block_table)
    assert not bm.grow(seq, 20)  # needs 3 more, 2 free
    assert seq.block_table == table and bm.num_free_blocks == 2
    assert bm.grow(seq, 16)
    assert bm.num_free_blocks == 0


# --- prefix caching --------------------------------------------------------------------------------


def test_match_prefix_hits_registered_blocks_and_counts_stats():
    bm = BlockManager(16, BS)
    prompt = list(range(100, 114))  # 3 full blocks + 2
    a = make_seq(prompt)
    assert bm.match_prefix(a) == 0
    compute(bm, a)
    bm.free(a)
    b = make_seq(prompt + [7, 7, 7])
    assert bm.match_prefix(b) == 12
    assert b.block_hashes == chained_hashes(prompt, 3)
    assert bm.num_prefix_hit_tokens == 0  # counted on admission, by the scheduler
    bm.record_prefix_lookup(len(b), 12)
    assert bm.num_prefix_hit_tokens == 12
    assert bm.num_prefix_queried_tokens == len(b)


def test_chained_hash_same_block_after_different_prefix_does_not_hit():
    bm = BlockManager(16, BS)
    a = make_seq([1, 1, 1, 1, 2, 2, 2, 2, 3])
    compute(bm, a)
    # block 1 has the same tokens as a's block 1, but block 0 differs
    b = make_seq([9, 9, 9, 9, 2, 2, 2, 2, 3])
    assert bm.match_prefix(b) == 0
    assert b.block_table == []
    # a differing middle block stops the match there, even though the block after it is identical
    c = make_seq([1, 1, 1, 1, 5, 5, 5, 5, 3, 3, 3, 3, 0])
    compute(bm, c)
    d = make_seq([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0])
    assert bm.match_prefix(d) == 8
    assert d.block_table == a.block_table[:2]
    assert block_hash(None, [2, 2, 2, 2]) != block_hash(block_hash(None, [1, 1, 1, 1]), [2, 2, 2, 2])
    assert block_hash(None, [0] * BS) != block_hash(0, [0] * BS)


def test_at_most_len_minus_one_tokens_hit():
    bm = BlockManager(16, BS)
    prompt = list(range(8))
    compute(bm, make_seq(prompt + [50]))
    same = make_seq(prompt)  # fully cached, but the last token must be computed for its logits
    assert bm.match_prefix(same) == 4
    longer = make_seq(prompt + [60])
    assert bm.match_prefix(longer) == 8
    single_block = make_seq(prompt[:4])
    assert bm.match_prefix(single_block) == 0


def test_register_full_blocks_only_hashes_computed_full_blocks():
    bm = BlockManager(16, BS)
    seq = make_seq(list(range(14)))
    assert bm.grow(seq, 14)
    seq.num_computed_tokens = 7
    bm.register_full_blocks(seq)
    assert len(seq.block_hashes) == 1
    assert bm.hash_to_block == {seq.block_hashes[0]: seq.block_table[0]}
    assert bm.blocks[seq.block_table[1]].hash is None
    seq.num_computed_tokens = 14
    bm.register_full_blocks(seq)
    assert seq.block_hashes == chained_hashes(seq.token_ids, 3)
    assert [bm.hash_to_block[h] for h in seq.block_hashes] == seq.block_table[:3]
    assert bm.blocks[seq.block_table[3]].hash is None
    bm.register_full_blocks(seq)  # idempotent
    assert len(seq.block_hashes) == 3 and len(bm.hash_to_block) == 3


def test_register_duplicate_content_keeps_first_block():
    bm = BlockManager(16, BS)
    a, b = make_seq(list(range(5)), request_id="a"), make_seq(list(range(5)), request_id="b")
    # both computed before either registered (same step): no prefix hit for b
    assert bm.grow(a, 5) and bm.grow(b, 5)
    a.num_computed_tokens = b.num_computed_tokens = 5
    bm.register_full_blocks(a)
    bm.register_full_blocks(b)
    assert b.block_hashes == a.block_hashes
    assert bm.hash_to_block[a.block_hashes[0]] == a.block_table[0]
    assert bm.blocks[b.block_table[0]].hash is None
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_prefix_caching_disabled():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = make_seq(list(range(9)))
    compute(bm, a)
    assert a.block_hashes == [] and bm.hash_to_block == {}
    b = make_seq(list(range(9)))
    assert bm.match_prefix(b) == 0


# --- LRU eviction ----------------------------------------------------------------------------------


def test_eviction_takes_oldest_freed_first_and_tail_before_head():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(8)) + [0], request_id="a")  # 2 full cached blocks + partial
    assert bm.grow(a, 8)
    a.num_computed_tokens = 8
    bm.register_full_blocks(a)
    b = make_seq(list(range(20, 28)) + [0], request_id="b")
    assert bm.grow(b, 8)
    b.num_computed_tokens = 8
    bm.register_full_blocks(b)
    a_head, a_tail = a.block_table
    b_head, b_tail = b.block_table
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 4
    # a was freed first (older), and within a sequence the tail goes before the head
    order = []
    for _ in range(4):
        (taken,) = bm.allocate_blocks(1)
        order.append(taken)
        assert bm.blocks[taken].hash is None
    assert order == [a_tail, a_head, b_tail, b_head]
    assert bm.hash_to_block == {}


def test_evicting_tail_keeps_head_hit():
    bm = BlockManager(3, BS)
    a = make_seq(list(range(9)))
    compute(bm, a)
    bm.free(a)
    bm.allocate_blocks(1)  # evicts a's partial tail block: it was released first
    bm.allocate_blocks(1)  # evicts a's second full block
    again = make_seq(list(range(9)))
    assert bm.match_prefix(again) == 4


def test_prefix_hit_refreshes_lru_position():
    bm = BlockManager(2, BS)
    a = make_seq([1, 1, 1, 1, 0], request_id="a")
    b = make_seq([2, 2, 2, 2, 0], request_id="b")
    for s in (a, b):
        assert bm.grow(s, 4)
        s.num_computed_tokens = 4
        bm.register_full_blocks(s)
    block_a, block_b = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    hit = make_seq([1, 1, 1, 1, 5])
    assert bm.match_prefix(hit) == 4  # a's block becomes most recently used when released again
    bm.free(hit)
    (taken,) = bm.allocate_blocks(1)
    assert taken == block_b
    assert bm.match_prefix(make_seq([1, 1, 1, 1, 5])) == 4
    assert bm.match_prefix(make_seq([2, 2, 2, 2, 5])) == 0
    assert bm.blocks[block_a].ref_count == 1 and block_b not in bm.free_blocks


def test_never_used_blocks_are_taken_before_cached_ones():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(4)) + [9])
    assert bm.grow(a, 4)
    a.num_computed_tokens = 4
    bm.register_full_blocks(a)
    bm.free(a)
    bm.allocate_blocks(3)
    assert bm.match_prefix(make_seq(list(range(4)) + [9])) == 4


# --- random operation sequences --------------------------------------------------------------------

PREFIXES = [[1] * 12, [1] * 8 + [2] * 4, [2] * 4 + [1] * 8, [3, 1, 3, 1] * 3]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random sequences with shared prefixes, driven like the scheduler drives the pool."""

    @initialize(num_blocks=st.integers(4, 16), caching=st.booleans())
    def setup(self, num_blocks, caching):
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
        self.seqs: list[Sequence] = []
        self.leases: list[list[int]] = []
        self.prefix_of_hash: dict[int, tuple[int, ...]] = {}
        self.hash_of_prefix: dict[tuple[int, ...], int] = {}
        self.num_created = 0

    @rule(
        prefix=st.sampled_from(PREFIXES),
        cut=st.sampled_from([0, 3, 4, 7, 8, 12]),
        suffix=st.lists(st.integers(0, 3), max_size=10),
        prefill=st.booleans(),
    )
    def new_sequence(self, prefix, cut, suffix, prefill):
        tokens = prefix[:cut] + suffix
        if not tokens:
            return
        seq = make_seq(tokens, request_id=str(self.num_created))
        self.num_created += 1
        cached = set(self.bm.hash_to_block)
        expected = 0
        if self.bm.enable_prefix_caching:
            for i in range((len(seq) - 1) // BS):
                if self.hash_of_prefix.get(tuple(tokens[: (i + 1) * BS])) not in cached:
                    break
                expected += BS
        num_hit = self.bm.match_prefix(seq)
        assert num_hit == expected
        assert num_hit <= len(seq) - 1 and num_hit % BS == 0
        assert len(seq.block_table) == num_hit // BS == len(seq.block_hashes)
        for i, block_id in enumerate(seq.block_table):
            assert self.prefix_of_hash[self.bm.blocks[block_id].hash] == tuple(tokens[: (i + 1) * BS])
        seq.num_computed_tokens = num_hit
        self.seqs.append(seq)
        if prefill and self.bm.grow(seq, len(seq)):
            seq.num_computed_tokens = len(seq)
            self._register(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def compute_chunk(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(data.draw(st.integers(0, 3)))
        num_new = data.draw(st.integers(1, seq.num_uncomputed_tokens))
        table, free = list(seq.block_table), self.bm.num_free_blocks
        if self.bm.grow(seq, seq.num_computed_tokens + num_new):
            seq.num_computed_tokens += num_new
            if data.draw(st.booleans()):
                self._register(seq)
        else:
            assert seq.block_table == table and self.bm.num_free_blocks == free
            assert self.bm.num_blocks_to_grow(seq, seq.num_computed_tokens + num_new) > free

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def register(self, data):
        self._register(data.draw(st.sampled_from(self.seqs)))

    def _register(self, seq: Sequence) -> None:
        self.bm.register_full_blocks(seq)
        if self.bm.enable_prefix_caching:
            assert len(seq.block_hashes) == seq.num_full_blocks
        for i, h in enumerate(seq.block_hashes):
            prefix = tuple(seq.token_ids[: (i + 1) * BS])
            assert self.prefix_of_hash.setdefault(h, prefix) == prefix
            assert self.hash_of_prefix.setdefault(prefix, h) == h

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        index = data.draw(st.integers(0, len(self.seqs) - 1))
        seq = self.seqs.pop(index)
        cached = {b: self.bm.blocks[b].hash for b in seq.block_table if self.bm.blocks[b].hash is not None}
        self.bm.free(seq)
        # freed blocks stay cached until a later allocation evicts them
        assert all(self.bm.hash_to_block[h] == b for b, h in cached.items())

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def speculate(self, data):
        """A decode verifying k drafted tokens, m of them accepted: the scheduler grows speculatively, the
        engine rolls back to the accepted length; with nothing new needed, the pool is as it was."""
        seq = data.draw(st.sampled_from(self.seqs))
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(data.draw(st.integers(0, 3)))
        if not self.bm.grow(seq, len(seq)):
            return
        k = data.draw(st.integers(1, 9))
        draft = data.draw(st.lists(st.integers(0, 3), min_size=k, max_size=k))
        before = self._pool_state()
        table, length = list(seq.block_table), len(seq)
        if not self.bm.grow_speculative(seq, length + k):
            assert seq.block_table == table and self._pool_state() == before
            return
        assert len(seq.block_table) == seq.blocks_needed(length + k)
        num_accepted = data.draw(st.integers(0, k))
        seq.num_computed_tokens = length + num_accepted
        self.bm.rollback([(seq, seq.num_computed_tokens)])
        assert len(seq.block_table) == max(len(table), seq.blocks_needed(seq.num_computed_tokens))
        assert seq.block_table[: len(table)] == table
        if len(seq.block_table) == len(table):
            assert self._pool_state() == before
        seq.token_ids.extend(draft[:num_accepted] + [data.draw(st.integers(0, 3))])
        if data.draw(st.booleans()):
            self._register(seq)

    def _pool_state(self):
        bm = self.bm
        return list(bm.free_blocks), dict(bm.hash_to_block), [(b.ref_count, b.hash) for b in bm.blocks]

    @rule(n=st.integers(1, 3))
    def lease(self, n):
        if self.bm.can_allocate(n):
            self.leases.append(self.bm.allocate_blocks(n))
        else:
            with pytest.raises(MemoryError):
                self.bm.allocate_blocks(n)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release_lease(self, data):
        ids = self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))
        self.bm.release_blocks(ids)

    @invariant()
    def pool_is_consistent(self):
        bm = self.bm
        owners = Counter(b for s in self.seqs for b in s.block_table)
        owners.update(b for ids in self.leases for b in ids)
        for block in bm.blocks:
            assert block.ref_count == owners[block.block_id]
            assert (block.block_id in bm.free_blocks) == (block.ref_count == 0)
            if block.hash is not None:
                assert bm.hash_to_block[block.hash] == block.block_id
        for h, block_id in bm.hash_to_block.items():
            assert bm.blocks[block_id].hash == h
        assert bm.num_free_blocks + len(owners) == bm.num_blocks
        for seq in self.seqs:
            assert len(set(seq.block_table)) == len(seq.block_table)
            assert len(seq.block_table) >= seq.blocks_needed(seq.num_computed_tokens)
            assert seq.block_hashes == chained_hashes(seq.token_ids, len(seq.block_hashes))
            assert len(seq.block_hashes) <= seq.num_full_blocks

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.seqs:
            self.bm.free(seq)
        for ids in self.leases:
            self.bm.release_blocks(ids)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        assert not self.bm.speculative_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
