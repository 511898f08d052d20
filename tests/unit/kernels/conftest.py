"""Kernel tests run on CPU through the Triton interpreter.

TRITON_INTERPRET must be set before a kernel is decorated (triton.jit picks the interpreter at
decoration time), so it is set when this conftest is imported, before the test modules here are
collected; kernel modules imported earlier in the session are reloaded.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

for _name in ("store_kvcache", "paged_decode", "chunked_prefill", "paged_attention", "quant_matmul"):
    _module = sys.modules.get(f"pdserve.kernels.{_name}")
    if _module is not None:
        importlib.reload(_module)
