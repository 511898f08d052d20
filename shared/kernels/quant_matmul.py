"""Weight-only quantized GEMM: y = x @ w.T with w dequantized on the fly from 4- or 8-bit codes.

w[n, k] = code[n, k] * scale[n, k // group] + offset[n, k // group] (pdserve.models.quantization).
Packed layouts (row n of the weight is row n of `packed`, K contiguous):
- bits 8: packed [N, K] uint8, the codes as they are;
- bits 4: packed [N, K / 2] uint8, byte j = code[n, 2 j] | code[n, 2 j + 1] << 4 (low nibble: even k),
  as `pack_int4` writes it. The kernel reads x at even and odd k as two half-K operands, one per nibble,
  so the codes are never interleaved back.
scale, offset: [N, K / group], float32 or float16 (read as float32), any strides: stored [K / group, N]
(`n_major`, as CudaQuantLinear keeps them) a tile's scales are one coalesced read. Dequantized tiles are
cast to x's dtype for `tl.dot`, accumulation is float32.

Grid (M / BLOCK_M, N / BLOCK_N, S): decode (M <= 16) is one 16-row tile per program over BLOCK_N
output channels, split over K into S slices when the N tiles alone do not fill the GPU (partials
[S, M, N] float32, summed after); prefill tiles M and N and keeps S = 1.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import upcast_for_interpreter

DECODE_ROWS = 16


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] (0..15, K even) -> [N, K / 2] uint8, low nibble = even k."""
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def n_major(t: torch.Tensor) -> torch.Tensor:
    """[N, G] scales or offsets as a view of [G, N] storage: the kernel's loads of them coalesce."""
    return t.t().contiguous().t()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] uint8 -> codes [N, K] uint8 (inverse of pack_int4)."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(1)


def dequantize_ref(
    packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, group_size: int
) -> torch.Tensor:
    """[N, K] float32: codes * scale + offset per group."""
    codes = unpack_int4(packed) if bits == 4 else packed
    n, k = codes.shape
    groups = codes.view(n, k // group_size, group_size).float()
    return torch.addcmul(offset.float()[:, :, None], groups, scale.float()[:, :, None]).reshape(n, k)


def quant_matmul_ref(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
    group_size: int,
) -> torch.Tensor:
    # x: [..., K] -> [..., N] in x's dtype, through the float32 weight
    w = dequantize_ref(packed, scale, offset, bits, group_size)
    return (x.float() @ w.t()).to(x.dtype)


@triton.jit
def _quant_matmul_kernel(
    x_ptr, packed_ptr, scale_ptr, offset_ptr, out_ptr,
    M, N, K, iters_per_split,
    stride_xm, stride_xk, stride_pn, stride_sn, stride_sg, stride_os, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SUB: tl.constexpr, UPCAST: tl.constexpr,
):
    # SUB: k per sub-tile; SUB divides GROUP (one scale per row of a sub-tile), or SUB == 0: every
    # element gathers its own scale (groups that neither divide nor are a multiple of BLOCK_K)
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    TILE_K: tl.constexpr = SUB if SUB > 0 else BLOCK_K
    STEP: tl.constexpr = 2 if BITS == 4 else 1  # k between consecutive bytes of a row
    offs_j = tl.arange(0, TILE_K // STEP)
    dot_dtype = tl.float32 if UPCAST else x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    it0 = pid_s * iters_per_split
    for it in range(it0, it0 + iters_per_split):
        for sub in tl.static_range(BLOCK_K // TILE_K):
            k0 = it * BLOCK_K + sub * TILE_K
            k = k0 + offs_j * STEP  # [TILE_K / STEP]: k of each byte's (low) code
            mask_k = k < K
            wmask = mask_k[:, None] & mask_n[None, :]
            # weight tiles are [TILE_K / STEP, BLOCK_N] (transposed): byte of k at packed[n, k / STEP]
            byte = tl.load(packed_ptr + offs_n[None, :] * stride_pn + (k // STEP)[:, None], mask=wmask, other=0)
            if SUB > 0:
                group = tl.minimum(k0, K - 1) // GROUP  # k0 >= K: x is masked to 0, any valid scale does
                at = offs_n[None, :] * stride_sn + group * stride_sg  # [1, BLOCK_N]
                smask = mask_n[None, :]
            else:
                at = offs_n[None, :] * stride_sn + (k // GROUP)[:, None] * stride_sg
                smask = wmask
            s = tl.load(scale_ptr + at, mask=smask, other=0.0).to(tl.float32)
            o = tl.load(offset_ptr + at, mask=smask, other=0.0).to(tl.float32)
            xmask = mask_m[:, None] & mask_k[None, :]
            x_at = x_ptr + offs_m[:, None] * stride_xm + k[None, :] * stride_xk  # [BLOCK_M, TILE_K / STEP]
            if BITS == 4:
                lo = ((byte & 15).to(tl.float32) * s + o).to(dot_dtype)
                hi = ((byte >> 4).to(tl.float32) * s + o).to(dot_dtype)
                x_even = tl.load(x_at, mask=xmask, other=0.0).to(dot_dtype)
                x_odd = tl.load(x_at + stride_xk, mask=xmask, other=0.0).to(dot_dtype)
                acc += tl.dot(x_even, lo, input_precision="ieee")
                acc += tl.dot(x_odd, hi, input_precision="ieee")
            else:
                w = (byte.to(tl.float32) * s + o).to(dot_dtype)
                xs = tl.load(x_at, mask=xmask, other=0.0).to(dot_dtype)
                acc += tl.dot(xs, w, input_precision="ieee")
    out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def choose_config(
    m: int, n: int, k: int, num_sms: int = 132, dtype: torch.dtype = torch.bfloat16
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits): decode splits K until ~2 programs per SM, each slice at
    least 4 BLOCK_K iterations; prefill uses 64 x 128 tiles (128 x 128 from 1024 rows; 64 x 64 in
    float32, whose larger tiles overflow shared memory)."""
    if m <= DECODE_ROWS:
        block_m, block_n, block_k = DECODE_ROWS, 64, 128
        iters = triton.cdiv(k, block_k)
        programs = triton.cdiv(n, block_n)
        splits = max(1, min(triton.cdiv(2 * num_sms, programs), iters // 4, 16))
        return block_m, block_n, block_k, splits
    if dtype == torch.float32:
        return 64, 64, 64, 1
    block_m = 128 if m >= 1024 else 64
    return block_m, 128, 64, 1


def sub_tile(bits: int, group_size: int, block_k: int) -> int:
    """k per sub-tile sharing one scale column (the kernel's SUB); 0: per-element scales."""
    if group_size % block_k == 0:
        return block_k
    if block_k % group_size == 0 and group_size >= 16 * (2 if bits == 4 else 1):  # tl.dot: K >= 16
        return group_size
    return 0


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def quant_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
    group_size: int, splits: int | None = None,
) -> torch.Tensor:
    """x [..., K] (fp32, fp16 or bf16) -> [..., N] in x's dtype; packed/scale/offset as in the module
    docstring. `splits` forces the split-K count (None: choose_config's)."""
    if bits not in (4, 8):
        raise ValueError(f"quant_matmul: bits must be 4 or 8, got {bits}")
    n = packed.shape[0]
    k = packed.shape[1] * (2 if bits == 4 else 1)
    if x.shape[-1] != k or k % group_size or scale.shape != (n, k // group_size) or offset.shape != scale.shape:
        raise ValueError(
            f"quant_matmul: x {tuple(x.shape)}, packed {tuple(packed.shape)} ({bits} bits), scale "
            f"{tuple(scale.shape)}, offset {tuple(offset.shape)} and group {group_size} do not agree"
        )
    assert packed.dtype == torch.uint8 and packed.stride(1) == 1 and offset.stride() == scale.stride()
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    block_m, block_n, block_k, chosen = choose_config(m, n, k, _num_sms(x.device), x.dtype)
    iters = triton.cdiv(k, block_k)
    splits = max(1, min(splits or chosen, iters))
    iters_per_split = triton.cdiv(iters, splits)
    splits = triton.cdiv(iters, iters_per_split)  # no empty slice
    if splits == 1:
        out = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    if m:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
        _quant_matmul_kernel[grid](
            rows, packed, scale, offset, out, m, n, k, iters_per_split,
            rows.stride(0), rows.stride(1), packed.stride(0), *scale.stride(), out.stride(0), out.stride(1),
            BITS=bits, GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            SUB=sub_tile(bits, group_size, block_k), UPCAST=upcast_for_interpreter(x.dtype),
        )
    y = out[0] if splits == 1 else out.sum(0).to(x.dtype)
    return y.view(*x.shape[:-1], n)
