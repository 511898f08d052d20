"""Weight-only quantized linears on CUDA: int4/int8 codes through the Triton dequant-GEMM
(pdserve.kernels.quant_matmul), FP8 weights through `torch._scaled_mm` (pdserve.kernels.fp8_matmul).

The kernel modules are imported on first forward, never at import of this one: CPU processes import
it without triton, and triton.jit picks compiler or interpreter at decoration time.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.models.quantization import QuantizedWeight


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    # the layout of pdserve.kernels.quant_matmul.pack_int4: byte j = code[2 j] | code[2 j + 1] << 4
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def _exact_half(t: torch.Tensor) -> torch.Tensor:
    """float16 where every value round-trips (GGUF's d and m do), else float32: half the scale bytes."""
    half = t.to(torch.float16)
    return half if torch.equal(half.float(), t.float()) else t.float()


def _n_major(t: torch.Tensor) -> torch.Tensor:
    # [N, G] as a view of [G, N] storage, as pdserve.kernels.quant_matmul.n_major: coalesced scale loads
    return t.t().contiguous().t()


class CudaQuantLinear(nn.Module):
    """y = x @ w.T + bias for w [out, in] held as 4/8-bit codes with group scales ("int4", "int8") or as
    float8_e4m3fn with a scale per output channel ("fp8")."""

    def __init__(
        self, kernel: str, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
        bias: torch.Tensor | None, in_features: int, group_size: int,
    ) -> None:
        super().__init__()
        self.kernel, self.in_features, self.out_features = kernel, in_features, packed.shape[0]
        self.group_size = group_size
        self.register_buffer("packed", packed)  # int4: [N, K / 2] uint8; int8: [N, K] uint8; fp8: [N, K]
        self.register_buffer("scale", scale)  # int: [N, K / group], N-major storage; fp8: [N] float32
        self.register_buffer("offset", offset)  # int: [N, K / group]; fp8: None
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    @classmethod
    def from_quantized(
        cls, weight: QuantizedWeight, bias: torch.Tensor | None, device: torch.device | str
    ) -> CudaQuantLinear:
        k = weight.codes.shape[1]
        if weight.bits not in (4, 8):
            raise ValueError(f"CudaQuantLinear: {weight.bits}-bit codes (4 or 8 only)")
        codes = weight.codes.to(device)
        packed = _pack_int4(codes) if weight.bits == 4 else codes.contiguous()
        scale, offset = _exact_half(weight.scale), _exact_half(weight.offset)
        if scale.dtype != offset.dtype:
            scale, offset = scale.float(), offset.float()
        return cls(
            f"int{weight.bits}", packed, _n_major(scale.to(device)), _n_major(offset.to(device)),
            bias.to(device) if bias is not None else None, k, weight.group_size,
        )

    @classmethod
    def from_float_fp8(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device | str
    ) -> CudaQuantLinear:
        """weight [out, in] float -> e4m3fn per output channel (refused without FP8 hardware)."""
        from pdserve.kernels.fp8_matmul import fp8_refusal, quantize_fp8_rows

        if (reason := fp8_refusal(device)) is not None:
            raise ValueError(f"quantization 'fp8': {reason}")
        w8, scale = quantize_fp8_rows(weight.detach().to(device))
        k = w8.shape[1]
        return cls("fp8", w8.contiguous(), scale, None, bias.to(device) if bias is not None else None, k, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        if self.kernel == "fp8":
            from pdserve.kernels.fp8_matmul import fp8_matmul

            y = fp8_matmul(x, self.packed, self.scale)
        else:
            from pdserve.kernels.quant_matmul import quant_matmul

            y = quant_matmul(x, self.packed, self.scale, self.offset, int(self.kernel[3:]), self.group_size)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32: the weight the kernel multiplies by."""
        if self.kernel == "fp8":
            return self.packed.float() * self.scale[:, None]
        from pdserve.kernels.quant_matmul import dequantize_ref

        return dequantize_ref(self.packed, self.scale, self.offset, int(self.kernel[3:]), self.group_size)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers()) + (
            self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        )

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}, group={self.group_size}"
        )


def quant_linear_for(
    weight: QuantizedWeight, bias: torch.Tensor | None, name: str, device: torch.device | str
) -> nn.Module:
    """The quantized linear for `device`: CudaQuantLinear on CUDA; on CPU NativeQuantLinear where pdserve's
    kernel is built and takes the shape, else QuantLinear over torch's kernels."""
    if torch.device(device).type == "cuda":
        return CudaQuantLinear.from_quantized(weight, bias, device)
    from pdserve.models.quant_linear import QuantLinear
    from pdserve.models.quant_linear_native import NativeQuantLinear, native_kernel_takes

    if native_kernel_takes(weight):
        return NativeQuantLinear(weight, bias)
    return QuantLinear(weight, bias, name)
