"""Chained content hashes of full KV blocks: the prefix-cache key, shared by the engine and the router.

Torch-free, so the router can hash a prompt and match it against replicas' prefix-hash summaries.
Block i's hash covers tokens [i·block_size, (i+1)·block_size) and, through its parent, every block before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    h = xxhash.xxh3_64(seed=0)
    h.update((parent if parent is not None else 0).to_bytes(8, "little"))
    h.update(b"\x01" if parent is not None else b"\x00")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> tuple[int, ...]:
    """Hashes of the blocks an engine could hit for this prompt: the full blocks before its last token
    (the last token is always computed, so it yields logits)."""
    hashes: list[int] = []
    parent = None
    for start in range(0, (len(token_ids) - 1) // block_size * block_size, block_size):
        parent = block_hash(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return tuple(hashes)
