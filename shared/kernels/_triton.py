"""Small helpers shared by the kernels."""

from __future__ import annotations

import torch
import triton


def upcast_for_interpreter(dtype: torch.dtype) -> bool:
    """True where the kernels must turn bf16 operands to fp32 before `tl.dot`.

    The Triton interpreter (TRITON_INTERPRET=1, the CPU test path) stores bf16 as raw uint16 and
    its `tl.dot` multiplies the bit patterns (triton-lang/triton#11584: bf16 not supported there),
    so under the interpreter bf16 tiles are upcast first; compiled kernels keep bf16 tensor cores.
    """
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)
