"""Handoff params: plain data that tells a decode worker where and how to pull a request's KV.

Like vLLM's `kv_transfer_params`, they travel in the prefill response; tensors never do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class HandoffParams:
    transport: str  # registry name: "ucx" | "redis" | "local"
    layout_hash: int
    lease_id: str  # the prefill side's lease on the blocks
    num_tokens: int  # tokens whose K/V the blocks hold
    block_ids: tuple[int, ...]  # block ids in the prefill pool, in sequence order
    block_hashes: tuple[int, ...] = ()  # chained hashes of the full blocks (content addresses)
    address: str | None = None  # peer host for point-to-point transports
    port: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        object.__setattr__(self, "block_hashes", tuple(int(h) for h in self.block_hashes))
        if self.num_tokens <= 0 or not self.block_ids:
            raise ValueError("a handoff carries at least one token and one block")
        if len(self.block_hashes) > len(self.block_ids):
            raise ValueError("more block hashes than blocks")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HandoffParams:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown handoff fields {sorted(unknown)}")
        return cls(**data)
