"""Validated kvstore configuration."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

EvictionPolicy = Literal[
    "noeviction", "allkeys-lru", "allkeys-lfu", "volatile-lru", "volatile-lfu", "allkeys-random",
    "volatile-random", "volatile-ttl",
]


class KVStoreConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    redis_url: str = "redis://127.0.0.1:6379/0"  # AUTH and TLS through the URL (redis://user:pass@, rediss://)
    key_prefix: str = Field("pdkv", pattern=r"^[A-Za-z0-9_.-]{1,32}$")
    ttl_s: int = Field(600, ge=1)  # lifetime of a stored block
    # Redis memory cap and eviction, set on startup when given; None leaves the server's setting.
    maxmemory_bytes: int | None = Field(None, ge=0)
    maxmemory_policy: EvictionPolicy | None = "allkeys-lru"
    socket_timeout_s: float = Field(5.0, gt=0)
    num_replicas: int = Field(1, ge=1)
