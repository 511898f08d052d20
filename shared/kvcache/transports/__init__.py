"""KV transports behind one ABC; `create_transport(name, ...)` builds one from the registry."""

from __future__ import annotations

from pdserve.kvcache.transports.base import KVTransferError, KVTransport, ReleaseFn
from pdserve.registry import load

TRANSPORTS: dict[str, str] = {
    "local": "pdserve.kvcache.transports.local:LocalTransport",
    "redis": "pdserve.kvcache.transports.redis:RedisTransport",
    "shm": "pdserve.kvcache.transports.shm:ShmTransport",
    "ucx": "pdserve.kvcache.transports.ucx:UCXTransport",
}


def transport_class(name: str) -> type[KVTransport]:
    return load(TRANSPORTS, name, "KV transport")


def create_transport(name: str, *args, **kwargs) -> KVTransport:
    return transport_class(name)(*args, **kwargs)


__all__ = ["TRANSPORTS", "KVTransferError", "KVTransport", "ReleaseFn", "create_transport", "transport_class"]
