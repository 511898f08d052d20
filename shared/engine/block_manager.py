"""KV block pool: allocation, refcounts, and prefix caching by chained block hash with LRU eviction.

Invariants:
- a block is in `free_blocks` iff its ref_count is 0;
- `hash_to_block[h] == b` implies `blocks[b].hash == h` (free blocks keep their hash until evicted);
- every block is owned by sequences, leases, or the free list; `num_free_blocks` counts the
  free list (cached-but-free blocks included), so it returns to `num_blocks` when all work is done;
- blocks taken for draft tokens (`grow_speculative`) are tracked until `rollback`: the ones whose
  drafts were rejected go back to the free list where they were, with the cached hash they held,
  so speculating and rejecting everything leaves the pool as it was.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pdserve.engine.sequence import Sequence
from pdserve.kv_events import KVEventLog
from pdserve.prefix_hash import block_hash  # noqa: F401 - re-exported: the engine's prefix-cache key


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.events = KVEventLog()  # every hash entering or leaving hash_to_block, for routers
        self.num_prefix_hit_tokens = 0
        self.num_prefix_queried_tokens = 0
        # block taken for drafts -> (order taken, the hash it held in the free list)
        self.speculative_blocks: dict[int, tuple[int, int | None]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        if not self.can_allocate(num_blocks):
            raise MemoryError(f"need {num_blocks} KV blocks, {self.num_free_blocks} free")
        return [self._take_free_block() for _ in range(num_blocks)]

    def release_blocks(self, block_ids: list[int]) -> None:
        # Reverse order: a sequence's tail blocks become the least recently used, evicted first.
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None

    def match_prefix(self, seq: Sequence) -> int:
        """Take cached full blocks for the sequence's prefix; returns the number of tokens hit.

        At most len(seq) - 1 tokens can hit, so the last token is always computed (it yields logits).
        """
        assert not seq.block_table
        if not self.enable_prefix_caching:
            return 0
        num_hashable = (len(seq) - 1) // self.block_size
        parent = None
        for index in range(num_hashable):
            h = block_hash(parent, seq.block_tokens(index))
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            self._ref(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        return len(seq.block_table) * self.block_size

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count a lookup once, when its sequence is admitted (a retried admission is not recounted)."""
        self.num_prefix_queried_tokens += num_queried
        self.num_prefix_hit_tokens += num_hit

    def num_blocks_to_grow(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, seq.blocks_needed(num_tokens) - len(seq.block_table))

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Ensure the block table covers `num_tokens` tokens; False (and no change) if the pool is short."""
        needed = self.num_blocks_to_grow(seq, num_tokens)
        if not self.can_allocate(needed):
            return False
        seq.block_table.extend(self._take_free_block() for _ in range(needed))
        return True

    def grow_speculative(self, seq: Sequence, num_tokens: int) -> bool:
        """`grow` for tokens that may be rolled back: the new blocks are tracked until `rollback`."""
        needed = self.num_blocks_to_grow(seq, num_tokens)
        if not self.can_allocate(needed):
            return False
        for _ in range(needed):
            block_id = next(iter(self.free_blocks))
            self.speculative_blocks[block_id] = (len(self.speculative_blocks), self.blocks[block_id].hash)
            seq.block_table.append(self._take_free_block())
        return True

    def rollback(self, kept: list[tuple[Sequence, int]]) -> None:
        """End a speculative step: each sequence keeps the blocks covering its first `n` tokens (and any
        it held before speculating); rejected draft blocks return to the front of the free list in
        reverse order of taking, their cached hash restored if no other block took it meanwhile."""
        dropped = []
        for seq, num_tokens in kept:
            keep = seq.blocks_needed(num_tokens)
            while len(seq.block_table) > keep and seq.block_table[-1] in self.speculative_blocks:
                dropped.append(seq.block_table.pop())
        for block_id in sorted(dropped, key=lambda b: self.speculative_blocks[b][0], reverse=True):
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is None, "a draft block is never shared or hashed"
            block.ref_count = 0
            previous = self.speculative_blocks[block_id][1]
            if previous is not None and previous not in self.hash_to_block:
                block.hash = previous
                self.hash_to_block[previous] = block_id
                self.events.stored(previous)
            self.free_blocks[block_id] = None
            self.free_blocks.move_to_end(block_id, last=False)
        self.speculative_blocks.clear()

    def register_full_blocks(self, seq: Sequence) -> None:
        """Hash the sequence's newly computed full blocks into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        for index in range(len(seq.block_hashes), seq.num_full_blocks):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, seq.block_tokens(index))
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[index]]
            if h not in self.hash_to_block and block.hash is None:
                block.hash = h
                self.hash_to_block[h] = block.block_id
                self.events.stored(h)

    def cache_blocks(self, block_ids: list[int], block_hashes: list[int]) -> int:
        """Release blocks whose contents are known (KV pulled from a shared store) into the prefix cache
        under their chained hashes; a hash already cached keeps its block. Returns the blocks cached."""
        num_cached = 0
        if self.enable_prefix_caching:
            for block_id, h in zip(block_ids, block_hashes):
                block = self.blocks[block_id]
                if h not in self.hash_to_block and block.hash is None:
                    block.hash = h
                    self.hash_to_block[h] = block_id
                    self.events.stored(h)
                    num_cached += 1
        self.release_blocks(block_ids)
        return num_cached

    def share(self, block_ids: list[int]) -> None:
        """One more reference to each block (a lease beside the sequence that holds them)."""
        for block_id in block_ids:
            self._ref(block_id)

    def free(self, seq: Sequence) -> None:
        self.release_blocks(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_blocks[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                self.events.evicted(block.hash)
            block.hash = None
        block.ref_count = 1
        return block_id
