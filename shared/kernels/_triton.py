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


def cache_operands(cache) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int], int]:
    """A K or V cache as kernel operands: (values, scales, scale strides (block, offset, head), quant code).

    Quant code 0: values in the model dtype and no scales (the values stand in for the scale pointer);
    1: int8 values; 2: fp8 e4m3 values, passed as their bytes (int8) and bitcast in the kernel.
    """
    from pdserve.kernels.kv_quant import QuantizedCache

    if not isinstance(cache, QuantizedCache):
        return cache, cache, (0, 0, 0), 0
    if cache.kv_cache_dtype == "int8":
        return cache.data, cache.scale, tuple(cache.scale.stride()), 1
    return cache.data.view(torch.int8), cache.scale, tuple(cache.scale.stride()), 2


def needs_upcast(q: torch.Tensor, cache) -> bool:
    """upcast_for_interpreter for the dtype the kernel multiplies in (q's when the cache is quantized)."""
    from pdserve.kernels.kv_quant import QuantizedCache

    return upcast_for_interpreter(q.dtype if isinstance(cache, QuantizedCache) else cache.dtype)
