"""KV layout contract: two engines exchange KV blocks only when their layout hashes agree."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
import xxhash

from pdserve.models.config import ModelConfig


class LayoutMismatch(ValueError):
    """The peer's KV layout differs from ours; the blocks are not interchangeable."""


@dataclass(frozen=True)
class KVLayout:
    model_fingerprint: str  # hash of the model config (architecture and shapes)
    dtype: str  # "float32" | "bfloat16" | "float16"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def itemsize(self) -> int:
        return torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: [num_layers, 2, block_size, num_kv_heads, head_dim]."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def layout_hash(self) -> int:
        canonical = json.dumps(asdict(self), sort_keys=True).encode()
        return xxhash.xxh3_64_intdigest(canonical)

    def check_compatible(self, peer_hash: int) -> None:
        if peer_hash != self.layout_hash:
            raise LayoutMismatch(
                f"KV layout hash {peer_hash:#018x} does not match ours {self.layout_hash:#018x} ({self})"
            )


def model_fingerprint(config: ModelConfig) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(asdict(config), sort_keys=True, default=str).encode())


def layout_of(config: ModelConfig, dtype: torch.dtype, block_size: int) -> KVLayout:
    return KVLayout(
        model_fingerprint=model_fingerprint(config),
        dtype=str(dtype).removeprefix("torch."),
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        block_size=block_size,
    )
