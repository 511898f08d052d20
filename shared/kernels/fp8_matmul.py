"""FP8 weights: float8_e4m3fn per output channel, multiplied by `torch._scaled_mm` (cuBLASLt FP8 GEMM).

At load a weight [N, K] becomes codes w8 = w / scale_w (e4m3fn, saturated to +-448) with scale_w [N]
float32 = amax of row n / 448. Each call quantizes the activation per row the same way (scale_x [M]),
and y[m, n] = sum_k x8[m, k] w8[n, k] * scale_x[m] * scale_w[n]. FP8 tensor cores need compute
capability >= 8.9 (Ada, Hopper); elsewhere `fp8_matmul` refuses. Plain torch: no Triton here.
"""

from __future__ import annotations

import torch

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0
ALIGN = 16  # _scaled_mm wants K and N multiples of 16; rows are padded to it too


def device_has_fp8(device: torch.device | str | None = None) -> bool:
    """True where `torch._scaled_mm` runs e4m3 GEMMs: CUDA with compute capability >= 8.9."""
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda" or not torch.cuda.is_available() or FP8_DTYPE is None:
        return False
    if not hasattr(torch, "_scaled_mm") or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_refusal(device: torch.device | str) -> str | None:
    """Why FP8 weights cannot be served on `device`, or None when they can."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"FP8 weights need a CUDA GPU with FP8 tensor cores, not {device.type}"
    if device_has_fp8(device):
        return None
    if not torch.cuda.is_available():
        return "FP8 weights need a CUDA GPU; none is visible"
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    return (
        f"FP8 weights need compute capability >= 8.9 (Ada/Hopper) and torch._scaled_mm; "
        f"{name} is {major}.{minor}"
    )


def quantize_fp8_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] float -> (e4m3fn [R, C], scale [R] float32), scale = row amax / 448."""
    if FP8_DTYPE is None:
        raise RuntimeError("this torch has no float8_e4m3fn")
    t = t.float()
    scale = (t.abs().amax(dim=1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    codes = (t / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def fp8_matmul_ref(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    # x: [..., K]; w8: [N, K] e4m3fn; w_scale: [N] -> [..., N] in x's dtype, the same math in float32
    rows = x.reshape(-1, x.shape[-1])
    x8, x_scale = quantize_fp8_rows(rows)
    y = (x8.float() @ w8.float().t()) * x_scale[:, None] * w_scale.float()[None, :]
    return y.to(x.dtype).view(*x.shape[:-1], w8.shape[0])


def fp8_matmul(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype through `torch._scaled_mm` with row-wise scales."""
    if (reason := fp8_refusal(x.device)) is not None:
        raise RuntimeError(reason)
    n, k = w8.shape
    if k % ALIGN or n % ALIGN:
        raise ValueError(f"fp8_matmul: weight [{n}, {k}]: both dims must be multiples of {ALIGN}")
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if pad := -m % ALIGN:
        rows = torch.nn.functional.pad(rows, (0, 0, 0, pad))
    x8, x_scale = quantize_fp8_rows(rows)
    y = torch._scaled_mm(
        x8, w8.t(), scale_a=x_scale[:, None].contiguous(), scale_b=w_scale.float()[None, :].contiguous(),
        out_dtype=torch.bfloat16,  # row-wise scaling takes bf16 output only
    )
    return y[:m].to(x.dtype).view(*x.shape[:-1], n)
