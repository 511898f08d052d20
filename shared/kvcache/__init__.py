"""KV handoff data plane: layout contract, wire format, pool access, transports.

Names load on first use (PEP 562), so a torch-free submodule (`redis_keys`, used by the kvstore) does
not import torch through this package."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HandoffParams": "pdserve.kvcache.params",
    "KVLayout": "pdserve.kvcache.layout",
    "KVPoolIO": "pdserve.kvcache.pool",
    "LayoutMismatch": "pdserve.kvcache.layout",
    "WireError": "pdserve.kvcache.wire",
    "layout_of": "pdserve.kvcache.layout",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdserve.kvcache' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
