"""Weight-only quantized linears on CPU through the native kernel (`cpu/quant_gemm.c`, built by
pdserve.kernels.cpu_native).

torch's CPU int4/int8 kernels are vectorized only for bfloat16 input and run at under half of one core's
bandwidth at one row; this kernel takes float32 input. On AVX-512 VNNI it multiplies the codes with x
held in two int8 planes per 32-element block (relative error under 2^-15 of the block's largest |x|) in
int32 dot products; elsewhere it dequantizes each row exactly and takes a float32 dot product.
"""

from __future__ import annotations

import ctypes

import torch

from pdserve.kernels.cpu_native import CACHE_ENV, FLAGS, KERNEL_ENV, _load, library, unavailable_reason

__all__ = ["CACHE_ENV", "FLAGS", "KERNEL_ENV", "PAIR", "_load", "isa", "library", "pack", "pack_order",
           "quant_dequant", "quant_gemm", "scales", "takes", "unavailable_reason"]

PAIR = 64  # elements per pair-block of the layout


def pack_order() -> torch.Tensor:
    """[64] element index held at each position of a pair-block (the C file's layout)."""
    p = torch.arange(PAIR)
    lane = p // 4
    return (lane % 2) * 32 + (lane // 2) * 4 + p % 4


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] uint8 -> the kernel's packed layout: [N, K] (8 bits) or [N, K / 2] (4 bits) uint8."""
    n, k = codes.shape
    placed = codes.reshape(n, k // PAIR, PAIR)[:, :, pack_order()]
    if bits == 8:
        return placed.reshape(n, k).contiguous()
    chunks = k // (2 * PAIR)  # two pairs per 64 bytes: the even pair's codes low, the odd pair's high
    body = placed[:, : 2 * chunks].reshape(n, chunks, 2, PAIR)
    parts = [(body[:, :, 0] | (body[:, :, 1] << 4)).reshape(n, -1)]
    if k % (2 * PAIR):  # a last pair alone: positions p (low) and p + 32 (high) in byte p
        last = placed[:, -1]
        parts.append(last[:, :32] | (last[:, 32:] << 4))
    return torch.cat(parts, dim=1).contiguous()


def isa(lib: ctypes.CDLL) -> str:
    """"vnni" (AVX-512 VNNI) or "avx2", both with x in two int8 planes, or "f32" (exact float32 dot
    products)."""
    return {1: "vnni", 2: "avx2"}.get(lib.pd_quant_isa(), "f32")


def takes(k: int, group: int) -> bool:
    """The layout's shapes: K a multiple of 64, scale groups of 32 or a multiple of 64 elements."""
    return k % PAIR == 0 and (group == 32 or group % PAIR == 0) and k % group == 0


def scales(scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scale, offset [N, K / group] as the kernel reads them: float16 where every value round-trips (GGUF's
    d and m do: half the bytes), else float32."""
    half = scale.half(), offset.half()
    if torch.equal(half[0].float(), scale.float()) and torch.equal(half[1].float(), offset.float()):
        return half[0].contiguous(), half[1].contiguous()
    return scale.float().contiguous(), offset.float().contiguous()


def quant_gemm(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, bits: int, scale: torch.Tensor,
               offset: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 contiguous -> [M, N] float32; scale, offset [N, K / group] from `scales`."""
    m, k = x.shape
    n, groups = scale.shape
    y = torch.empty(m, n, dtype=torch.float32)
    lib.pd_quant_gemm(x.data_ptr(), m, k, packed.data_ptr(), bits, scale.data_ptr(), offset.data_ptr(),
                      scale.dtype is torch.float16, k // groups, n, y.data_ptr())
    return y


def quant_dequant(lib: ctypes.CDLL, packed: torch.Tensor, bits: int, scale: torch.Tensor,
                  offset: torch.Tensor, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
    """Rows start:end of w into `out` [end - start, K] float32 (exactly code * scale + offset)."""
    k = out.shape[1]
    lib.pd_quant_dequant(packed.data_ptr(), bits, scale.data_ptr(), offset.data_ptr(),
                         scale.dtype is torch.float16, k // scale.shape[1], start, end, k, out.data_ptr())
    return out
