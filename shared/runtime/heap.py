"""Handing freed heap memory back to the OS (glibc)."""

from __future__ import annotations

import contextlib
import ctypes


def trim_heap() -> None:
    """glibc keeps the pages of freed large buffers (a load's transients, a long batch's activations) in its
    arenas, where a process's RSS keeps them while it idles; malloc_trim returns them. A no-op elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
