"""Triton attention kernels over the paged KV cache, each beside its torch reference (`*_ref`).

Backend choice: `attention_backend(device)` is "triton" on CUDA and "torch" elsewhere; an explicit
`override` argument, else the env var PDSERVE_ATTENTION_BACKEND=torch|triton, forces either.

The kernel modules are imported on first use of one of their names, never by importing this
package: `triton.jit` decides at decoration time between compiling and the CPU interpreter
(TRITON_INTERPRET=1), and the torch backend must not need triton at all.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

BACKEND_ENV = "PDSERVE_ATTENTION_BACKEND"
BACKENDS = ("torch", "triton")

_LAZY = {
    "store_kvcache_ref": "store_kvcache",
    "store_kvcache_triton": "store_kvcache",
    "choose_num_splits": "paged_decode",
    "paged_decode_attention": "paged_decode",
    "paged_decode_attention_ref": "paged_decode",
    "chunked_prefill_attention": "chunked_prefill",
    "chunked_prefill_attention_ref": "chunked_prefill",
    "paged_attention_triton": "paged_attention",
}


def attention_backend(device: torch.device | str | None = None, override: str | None = None) -> str:
    """"torch" or "triton" for attention on `device` (default: CUDA when available)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device_type = torch.device(device).type
    choice = override or os.environ.get(BACKEND_ENV) or ("triton" if device_type == "cuda" else "torch")
    if choice not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {choice!r} (from {BACKEND_ENV}?)")
    if choice == "triton" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "the triton attention backend on CPU needs TRITON_INTERPRET=1, set before triton is imported"
        )
    return choice


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(f"{__name__}.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS", "BACKEND_ENV", "attention_backend", "choose_num_splits", "chunked_prefill_attention",
    "chunked_prefill_attention_ref", "paged_attention_triton", "paged_decode_attention",
    "paged_decode_attention_ref", "store_kvcache_ref", "store_kvcache_triton",
]
