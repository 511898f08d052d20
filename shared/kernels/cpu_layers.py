"""RMSNorm and the rotary embedding in float32 on CPU through the native library (`cpu/norm_rope.c`,
built by pdserve.kernels.cpu_native): one call each where torch runs a chain of small ops, which at one
decode token cost more than the arithmetic (about 60 us an RMSNorm here)."""

from __future__ import annotations

import torch

from pdserve.kernels.cpu_native import library


def _plain_f32(t: torch.Tensor) -> bool:
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype is torch.float32
            and t.device.type == "cpu")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / rms(x) over the last dim, or None where the native path does not take x (not a
    contiguous float32 CPU tensor, autograd on, or no library)."""
    lib = library()
    if (lib is None or not (_plain_f32(x) and _plain_f32(weight) and x.is_contiguous())
            or torch.is_grad_enabled()):
        return None
    size = x.shape[-1]
    out = torch.empty_like(x)
    lib.pd_rms_norm(x.data_ptr(), weight.data_ptr(), x.numel() // size, size, eps, out.data_ptr())
    return out


def rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, heads, D] (tokens may be strided, heads and D packed) rotated at `positions` [T] into a new
    contiguous tensor, bit-identical to pdserve.models.rotary._rotate; None where the native path does not
    take it."""
    lib = library()
    if (lib is None or not (_plain_f32(x) and _plain_f32(cos)) or x.dim() != 3 or torch.is_grad_enabled()
            or x.stride(2) != 1 or x.stride(1) != x.shape[2] or positions.dtype is not torch.int64
            or not (positions.is_contiguous() and cos.is_contiguous() and sin.is_contiguous())):
        return None
    tokens, heads, head_dim = x.shape
    out = torch.empty(tokens, heads, head_dim)
    if lib.pd_rotary(x.data_ptr(), tokens, heads, x.stride(0), head_dim, positions.data_ptr(), cos.data_ptr(),
                     sin.data_ptr(), cos.shape[0], out.data_ptr()):
        raise IndexError(f"rotary: a position is outside the table's {cos.shape[0]} positions")
    return out
