"""Versioned binary wire format for KV blocks. Never pickle.

    header   <4s H H Q I Q>  magic b"PDKV", version, flags (0), layout hash, num_blocks, block_nbytes
    table    num_blocks x <Q Q>  chained block hash, xxh3-64 checksum of the block's bytes
    tail     <Q>  xxh3-64 of header + table
    payload  num_blocks x block_nbytes raw bytes, in table order
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from pdserve.kvcache.layout import LayoutMismatch

MAGIC = b"PDKV"
VERSION = 1
_HEAD = struct.Struct("<4sHHQIQ")
_ENTRY = struct.Struct("<QQ")
_TAIL = struct.Struct("<Q")
DEFAULT_MAX_BLOCKS = 1 << 16


class WireError(ValueError):
    """A KV payload was truncated, corrupt, oversized or of another version; nothing was applied."""


@dataclass(frozen=True)
class WireHeader:
    layout_hash: int
    block_nbytes: int
    block_hashes: tuple[int, ...]
    checksums: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def nbytes(self) -> int:
        return header_size(self.num_blocks)

    @property
    def payload_nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes


def header_size(num_blocks: int) -> int:
    return _HEAD.size + num_blocks * _ENTRY.size + _TAIL.size


def checksum(block: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(block)


def encode_header(
    layout_hash: int, block_nbytes: int, block_hashes: Sequence[int], blocks: Sequence[memoryview | bytes]
) -> bytes:
    if len(block_hashes) != len(blocks):
        raise ValueError("one block hash per block")
    parts = [_HEAD.pack(MAGIC, VERSION, 0, layout_hash, len(blocks), block_nbytes)]
    for h, block in zip(block_hashes, blocks):
        if memoryview(block).nbytes != block_nbytes:
            raise ValueError("every block must be block_nbytes long")
        parts.append(_ENTRY.pack(h, checksum(block)))
    body = b"".join(parts)
    return body + _TAIL.pack(xxhash.xxh3_64_intdigest(body))


def peek_num_blocks(buf: memoryview | bytes) -> int:
    """Number of blocks announced by a fixed-size header prefix (to size the rest of the read)."""
    if len(buf) < _HEAD.size:
        raise WireError(f"truncated KV header: {len(buf)} < {_HEAD.size} bytes")
    magic, version, _, _, num_blocks, _ = _HEAD.unpack_from(buf)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r}: not a pdserve KV payload")
    if version != VERSION:
        raise WireError(f"unsupported KV wire version {version} (this side speaks {VERSION})")
    return num_blocks


def decode_header(
    buf: memoryview | bytes, expected_layout_hash: int, expected_block_nbytes: int,
    max_blocks: int = DEFAULT_MAX_BLOCKS,
) -> WireHeader:
    num_blocks = peek_num_blocks(buf)
    if num_blocks > max_blocks:
        raise WireError(f"oversized KV payload: {num_blocks} blocks > limit {max_blocks}")
    size = header_size(num_blocks)
    if len(buf) < size:
        raise WireError(f"truncated KV header: {len(buf)} < {size} bytes")
    _, _, flags, layout_hash, _, block_nbytes = _HEAD.unpack_from(buf)
    (tail,) = _TAIL.unpack_from(buf, size - _TAIL.size)
    if tail != xxhash.xxh3_64_intdigest(bytes(buf[: size - _TAIL.size])):
        raise WireError("corrupt KV header: checksum mismatch")
    if flags != 0:
        raise WireError(f"unknown KV header flags {flags:#x}")
    if layout_hash != expected_layout_hash:
        raise LayoutMismatch(f"KV layout hash {layout_hash:#018x} != ours {expected_layout_hash:#018x}")
    if block_nbytes != expected_block_nbytes:
        raise WireError(f"KV block size {block_nbytes} bytes != ours {expected_block_nbytes}")
    entries = [_ENTRY.unpack_from(buf, _HEAD.size + i * _ENTRY.size) for i in range(num_blocks)]
    return WireHeader(layout_hash, block_nbytes, tuple(e[0] for e in entries), tuple(e[1] for e in entries))


def verify_blocks(header: WireHeader, blocks: Sequence[memoryview | bytes]) -> None:
    if len(blocks) != header.num_blocks:
        raise WireError(f"truncated KV payload: {len(blocks)} of {header.num_blocks} blocks")
    verify_block_run(header, 0, blocks)


def verify_block_run(header: WireHeader, first: int, blocks: Sequence[memoryview | bytes]) -> None:
    """Checks payload blocks first .. first + len(blocks) - 1 (a transfer verifies piece by piece)."""
    if not 0 <= first <= first + len(blocks) <= header.num_blocks:
        raise WireError(f"KV blocks {first}..{first + len(blocks) - 1} outside a payload of {header.num_blocks}")
    for i, (block, expected) in enumerate(zip(blocks, header.checksums[first:]), start=first):
        if memoryview(block).nbytes != header.block_nbytes:
            raise WireError(f"truncated KV block {i}: {memoryview(block).nbytes} of {header.block_nbytes} bytes")
        if checksum(block) != expected:
            raise WireError(f"corrupt KV block {i}: checksum mismatch")
