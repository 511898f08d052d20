"""KV layout contract: two engines exchange KV blocks only when their layout hashes agree."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
import xxhash

from pdserve.kernels.kv_quant import QUANT_DTYPES, SCALE_DTYPE, SCALE_LAYOUT
from pdserve.kvcache.quant import value_dtype
from pdserve.models.config import ModelConfig


class LayoutMismatch(ValueError):
    """The peer's KV layout differs from ours; the blocks are not interchangeable."""


@dataclass(frozen=True)
class KVLayout:
    # weight quantization is not part of it: KV values are in the activation dtype or kv_cache_dtype either way
    model_fingerprint: str  # hash of the model config (architecture and shapes)
    dtype: str  # of the stored values: "float32" | "bfloat16" | "float16" | "int8" | "float8_e4m3fn"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    # "none", or "token_head:float16" for quantized values: one scale per (token, KV head) after the values
    scale_layout: str = "none"

    @property
    def is_quantized(self) -> bool:
        return self.scale_layout != "none"

    @property
    def itemsize(self) -> int:
        return torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block: values [num_layers, 2, block_size, num_kv_heads, head_dim], then (quantized)
        scales [num_layers, 2, block_size, num_kv_heads]."""
        rows = self.num_layers * 2 * self.block_size * self.num_kv_heads
        scales = rows * torch.empty((), dtype=SCALE_DTYPE).element_size() if self.is_quantized else 0
        return rows * self.head_dim * self.itemsize + scales

    @property
    def bytes_per_token(self) -> int:
        return self.block_nbytes // self.block_size

    @property
    def layout_hash(self) -> int:
        fields = asdict(self)
        if not self.is_quantized:
            del fields["scale_layout"]  # unquantized layouts keep the hash they had before KV quantization
        canonical = json.dumps(fields, sort_keys=True).encode()
        return xxhash.xxh3_64_intdigest(canonical)

    def check_compatible(self, peer_hash: int) -> None:
        if peer_hash != self.layout_hash:
            raise LayoutMismatch(
                f"KV layout hash {peer_hash:#018x} does not match ours {self.layout_hash:#018x} ({self})"
            )


def model_fingerprint(config: ModelConfig) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(asdict(config), sort_keys=True, default=str).encode())


def layout_of(config: ModelConfig, dtype: torch.dtype, block_size: int, kv_cache_dtype: str = "auto") -> KVLayout:
    """`dtype` is the model dtype; with another `kv_cache_dtype` the values are stored in that instead."""
    quantized = kv_cache_dtype in QUANT_DTYPES
    stored = value_dtype(dtype, kv_cache_dtype)
    return KVLayout(
        model_fingerprint=model_fingerprint(config),
        dtype=str(stored).removeprefix("torch."),
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        block_size=block_size,
        scale_layout=SCALE_LAYOUT if quantized else "none",
    )
