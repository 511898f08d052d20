"""kvstore service: index, policy and stats of the Redis-backed KV block store."""

from pdserve.services.kvstore.config import KVStoreConfig
from pdserve.services.kvstore.store import KVStore

__all__ = ["KVStore", "KVStoreConfig"]
