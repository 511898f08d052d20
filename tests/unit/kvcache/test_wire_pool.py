"""Wire header checks piece by piece, and the engine's host KV pool allocation."""

import mmap
import re

import pytest
import torch

from pdserve.kvcache import wire
from pdserve.kvcache.pool import KVPoolIO, allocate_pool

BLOCK_NBYTES = 64


def _blocks(n: int, seed: int = 0) -> list[bytes]:
    gen = torch.Generator().manual_seed(seed)
    return [bytes(torch.randint(0, 256, (BLOCK_NBYTES,), generator=gen, dtype=torch.uint8).numpy()) for _ in range(n)]


def _header(blocks: list[bytes]) -> wire.WireHeader:
    raw = wire.encode_header(0xABC, BLOCK_NBYTES, list(range(1, len(blocks) + 1)), blocks)
    return wire.decode_header(raw, 0xABC, BLOCK_NBYTES)


def test_block_runs_verify_piece_by_piece_like_the_whole():
    blocks = _blocks(7)
    header = _header(blocks)
    wire.verify_blocks(header, blocks)
    wire.verify_block_run(header, 0, blocks[:3])
    wire.verify_block_run(header, 3, blocks[3:])
    wire.verify_block_run(header, 7, [])


def test_a_corrupt_block_is_named_by_its_payload_index():
    blocks = _blocks(7)
    header = _header(blocks)
    bad = blocks[3:5]
    bad[1] = bytes(BLOCK_NBYTES)
    with pytest.raises(wire.WireError, match="corrupt KV block 4"):
        wire.verify_block_run(header, 3, bad)
    with pytest.raises(wire.WireError, match="corrupt KV block 0"):
        wire.verify_block_run(header, 0, blocks[3:5])  # right bytes, wrong place


@pytest.mark.parametrize("first,count", [(-1, 1), (6, 2), (8, 0)])
def test_runs_outside_the_payload_are_refused(first, count):
    blocks = _blocks(7)
    with pytest.raises(wire.WireError, match="outside a payload of 7"):
        wire.verify_block_run(_header(blocks), first, blocks[:count])


def test_verify_blocks_still_refuses_a_short_payload():
    blocks = _blocks(4)
    with pytest.raises(wire.WireError, match="truncated KV payload: 3 of 4"):
        wire.verify_blocks(_header(blocks), blocks[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_pool_is_zeroed_contiguous_and_writable(dtype):
    shape = (5, 2, 2, 4, 2, 8)
    pool = allocate_pool(shape, dtype, "cpu")
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert not pool.any()
    pool[3].fill_(1.5)
    io = KVPoolIO(pool)
    assert io.block_nbytes == pool[0].numel() * pool.element_size()
    assert torch.equal(torch.frombuffer(io.block_buffer(3), dtype=dtype), torch.full((pool[0].numel(),), 1.5, dtype=dtype))
    assert not pool[:3].any() and not pool[4:].any()


def _anon_huge_kb(address: int) -> int | None:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    current = None
    for line in open("/proc/self/smaps"):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            current = int(m[1], 16) <= address < int(m[2], 16)
        elif current and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


def test_host_pool_asks_for_huge_pages():
    try:
        thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages on this kernel")
    if "[never]" in thp or not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("transparent huge pages are off")
    pool = allocate_pool((64 << 20,), torch.uint8, "cpu")  # 64 MiB: many 2 MiB pages
    pool.fill_(1)
    # the kernel may be short of free huge pages; a private anonymous mapping normally gets some
    assert _anon_huge_kb(pool.data_ptr()) > 0
