"""kvstore service: index, policy and stats of the Redis-backed KV block store.

Public API: `KVStoreConfig`, `KVStore`. Importing the config never imports torch (the store does).
"""

from pdserve.services.kvstore.config import KVStoreConfig

__all__ = ["KVStore", "KVStoreConfig"]


def __getattr__(name: str):
    if name == "KVStore":
        from pdserve.services.kvstore.store import KVStore

        return KVStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
