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

Two paths, `quant_matmul` choosing by M (or `path=`):
- "gemv" (M <= GEMV_ROWS): no tl.dot. A program owns BLOCK_N output channels and a K slice, reads
  [BLOCK_N, BLOCK_K / STEP] byte tiles (wide contiguous loads along K), and for each of its <= 8 rows
  of x sums code * x per group in float32, then applies the group's scale and offset once:
  y[n] = sum_g scale[n, g] * sum_{k in g} code[n, k] x[k] + offset[n, g] * sum_{k in g} x[k].
  The weight tile is read once for all rows; rows beyond 8 are further programs.
- "dot": grid (M / BLOCK_M, N / BLOCK_N, S), dequantized tiles through tl.dot; at M <= 16 one 16-row
  tile per program over BLOCK_N output channels.
Both split K into S slices when the N tiles alone do not fill the GPU (partials [S, M, N] float32,
summed after).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels._triton import upcast_for_interpreter

DECODE_ROWS = 16
GEMV_ROWS = 8  # "gemv" path up to this many rows (rows of x per program)
GEMV_WAVES = 4  # split K until ~this many gemv programs per SM: bytes in flight for the memory system


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


@triton.jit
def _quant_gemv_kernel(
    x_ptr, packed_ptr, scale_ptr, offset_ptr, out_ptr,
    M, N, K, iters_per_split,
    stride_xm, stride_xk, stride_pn, stride_sn, stride_sg, stride_os, stride_om,
    BITS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SUBK: tl.constexpr, PER_ELEM: tl.constexpr,
):
    # a tile is [BLOCK_N, BLOCK_K / SUBK, SUBK / STEP] bytes: SUBK k share one scale column per row
    # (SUBK divides GROUP or GROUP divides BLOCK_K), or PER_ELEM: every byte gathers its own scale
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    STEP: tl.constexpr = 2 if BITS == 4 else 1
    GPT: tl.constexpr = BLOCK_K // SUBK
    GB: tl.constexpr = SUBK // STEP
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    n3 = offs_n[:, None, None]
    j = tl.arange(0, GPT)[:, None] * GB + tl.arange(0, GB)[None, :]  # [GPT, GB]: byte in the tile
    rows = tl.arange(0, ROWS)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    it0 = pid_s * iters_per_split
    for it in range(it0, it0 + iters_per_split):
        k0 = it * BLOCK_K
        k = k0 + j * STEP  # [GPT, GB]: k of each byte's (low) code
        jb = k0 // STEP + j  # byte of k in its row: the mask is over contiguous bytes, the loads vectorize
        mask_k = jb < K // STEP
        wmask = mask_n[:, None, None] & mask_k[None, :, :]
        byte = tl.load(packed_ptr + n3 * stride_pn + jb[None, :, :], mask=wmask, other=0)
        if PER_ELEM:
            at = n3 * stride_sn + (k // GROUP)[None, :, :] * stride_sg
            smask = wmask
        else:
            kg = k0 + tl.arange(0, GPT) * SUBK  # [GPT]
            at = offs_n[:, None] * stride_sn + (kg // GROUP)[None, :] * stride_sg  # [BLOCK_N, GPT]
            smask = mask_n[:, None] & (kg < K)[None, :]
        s = tl.load(scale_ptr + at, mask=smask, other=0.0).to(tl.float32)
        o = tl.load(offset_ptr + at, mask=smask, other=0.0).to(tl.float32)
        if BITS == 4:
            lo = (byte & 15).to(tl.float32)
            hi = (byte >> 4).to(tl.float32)
            if PER_ELEM:
                lo = lo * s + o
                hi = hi * s + o
        else:
            lo = byte.to(tl.float32)
            if PER_ELEM:
                lo = lo * s + o
        for r in tl.static_range(ROWS):
            m = tl.minimum(pid_m * ROWS + r, M - 1)  # rows past M: computed, never stored
            x_at = x_ptr + m * stride_xm + k * stride_xk  # [GPT, GB]
            xe = tl.load(x_at, mask=mask_k, other=0.0).to(tl.float32)
            prod = lo * xe[None, :, :]
            if BITS == 4:
                xo = tl.load(x_at + stride_xk, mask=mask_k, other=0.0).to(tl.float32)
                prod += hi * xo[None, :, :]
            if PER_ELEM:
                part = tl.sum(tl.sum(prod, axis=2), axis=1)  # [BLOCK_N]
            else:
                xsum = tl.sum(xe, axis=1)  # [GPT]
                if BITS == 4:
                    xsum += tl.sum(xo, axis=1)
                part = tl.sum(s * tl.sum(prod, axis=2) + o * xsum[None, :], axis=1)
            acc = tl.where((rows == r)[:, None], acc + part[None, :], acc)
    offs_m = pid_m * ROWS + rows
    out = out_ptr + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & mask_n[None, :])


def gemv_config(m: int, n: int, k: int, bits: int, num_sms: int = 132) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_N, BLOCK_K, splits) of the gemv path: 256 bytes of each of 16 weight rows per
    iteration; K split until ~GEMV_WAVES programs per SM, at most 16 slices."""
    rows = min(triton.next_power_of_2(max(m, 1)), GEMV_ROWS)
    block_n, block_k = 16, 256 * (2 if bits == 4 else 1)
    iters = triton.cdiv(k, block_k)
    programs = triton.cdiv(n, block_n) * triton.cdiv(max(m, 1), rows)
    splits = max(1, min(triton.cdiv(GEMV_WAVES * num_sms, programs), iters, 16))
    return rows, block_n, block_k, splits


def gemv_sub_tile(bits: int, group_size: int, block_k: int) -> int:
    """k per sub-tile sharing one scale column (the gemv kernel's SUBK); 0: per-element scales."""
    subk = min(group_size, block_k)
    if (group_size % block_k == 0 or block_k % group_size == 0) and subk >= (2 if bits == 4 else 1):
        return subk
    return 0


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
    group_size: int, splits: int | None = None, path: str | None = None,
) -> torch.Tensor:
    """x [..., K] (fp32, fp16 or bf16) -> [..., N] in x's dtype; packed/scale/offset as in the module
    docstring. `splits` forces the split-K count (None: the path's config); `path` forces "gemv" or
    "dot" (None: "gemv" up to GEMV_ROWS rows)."""
    if bits not in (4, 8):
        raise ValueError(f"quant_matmul: bits must be 4 or 8, got {bits}")
    if path not in (None, "gemv", "dot"):
        raise ValueError(f"quant_matmul: path must be 'gemv', 'dot' or None, got {path!r}")
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
    gemv = path == "gemv" or (path is None and m <= GEMV_ROWS)
    if gemv:
        block_m, block_n, block_k, chosen = gemv_config(m, n, k, bits, _num_sms(x.device))
    else:
        block_m, block_n, block_k, chosen = choose_config(m, n, k, _num_sms(x.device), x.dtype)
    iters = triton.cdiv(k, block_k)
    splits = max(1, min(splits or chosen, iters))
    iters_per_split = triton.cdiv(iters, splits)
    splits = triton.cdiv(iters, iters_per_split)  # no empty slice
    if splits == 1:
        out = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    args = (rows, packed, scale, offset, out, m, n, k, iters_per_split, rows.stride(0), rows.stride(1),
            packed.stride(0), *scale.stride(), out.stride(0), out.stride(1))
    if m and gemv:
        grid = (triton.cdiv(n, block_n), splits, triton.cdiv(m, block_m))
        subk = gemv_sub_tile(bits, group_size, block_k)
        _quant_gemv_kernel[grid](
            *args, BITS=bits, GROUP=group_size, ROWS=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            SUBK=subk or block_k, PER_ELEM=subk == 0, num_warps=4,
        )
    elif m:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
        _quant_matmul_kernel[grid](
            *args, BITS=bits, GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            SUB=sub_tile(bits, group_size, block_k), UPCAST=upcast_for_interpreter(x.dtype),
        )
    y = out[0] if splits == 1 else out.sum(0).to(x.dtype)
    return y.view(*x.shape[:-1], n)
