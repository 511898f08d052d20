"""The router's prompt hashes are the engine's prefix-cache keys, computed without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.sequence import Sequence
from pdserve.prefix_hash import prompt_block_hashes
from pdserve.sampling_params import SamplingParams


@pytest.mark.parametrize("num_tokens", [1, 4, 5, 8, 9, 23])
def test_prompt_hashes_are_what_the_engine_hits(num_tokens):
    tokens = list(range(100, 100 + num_tokens))
    bm = BlockManager(16, 4)
    cached = Sequence("a", tokens + [7], SamplingParams(), 4)
    assert bm.grow(cached, len(cached))
    cached.num_computed_tokens = len(cached)
    bm.register_full_blocks(cached)
    hashes = prompt_block_hashes(tokens, 4)
    assert len(hashes) == (num_tokens - 1) // 4
    assert hashes == tuple(cached.block_hashes[: len(hashes)])
    probe = Sequence("b", tokens, SamplingParams(), 4)
    assert bm.match_prefix(probe) == 4 * len(hashes)


def test_prefix_hash_is_torch_free():
    code = "import sys, pdserve.prefix_hash; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
