"""KV handoff data plane: layout contract, wire format, pool access, transports."""

from pdserve.kvcache.layout import KVLayout, LayoutMismatch, layout_of
from pdserve.kvcache.params import HandoffParams
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.wire import WireError

__all__ = ["HandoffParams", "KVLayout", "KVPoolIO", "LayoutMismatch", "WireError", "layout_of"]
