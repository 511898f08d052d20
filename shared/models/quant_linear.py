"""Weight-only quantized linears and embeddings on CPU, over the kernels torch ships.

Kernels (`python -m pdserve.bench.linears_quant` times them against float32 per shape; docs/quantization.md):
- int4: `aten._weight_int4pack_mm_for_cpu`, group scales and zeros, w = (q - 8) * scale + zero;
- int8 with group scales: the same int4 kernel over two 4-bit planes of each 8-bit code, the input
  repeated along K (u = 16 hi + lo, so w = 16 s (hi - 8) + [s (lo - 8) + offset + 136 s]);
- int8 per output channel (symmetric): `torch._weight_int8pack_mm`.
Torch 2.13 vectorizes these only for bfloat16 (float32 input runs a scalar loop ~30x slower), so up to
`max_kernel_rows` rows the input, the kernel's scales and its output are bfloat16. Above it (prefill) the
weight is dequantized exactly to float32, DEQUANT_CHUNK output rows at a time into reused buffers: the
stored copy is the quantized one only.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import nn

from pdserve.models.quantization import QuantizedWeight

MAX_KERNEL_ROWS = 32
DEQUANT_CHUNK = 1024  # output rows dequantized at a time above max_kernel_rows (a [1024, K] float32 buffer)
_WORKSPACE: dict[str, torch.Tensor] = {}  # reused dequantization buffers: fresh large ones page-fault


def _scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    size = math.prod(shape)
    buffer = _WORKSPACE.get(name)
    if buffer is None or buffer.numel() < size or buffer.dtype != dtype:
        buffer = _WORKSPACE[name] = torch.empty(size, dtype=dtype)
    return buffer[:size].view(shape)


@dataclass(frozen=True)
class Int4Layout:
    """Torch's CPU int4 weight layout, [N / block_rows, K, block_rows / 2] bytes: byte [b, k, j] holds
    column k of row `order()[j]` of block b in its low nibble and of row `order()[half + j]` in its high one."""

    block_rows: int  # 4 float vectors: 64 under AVX-512, 32 under AVX2 or torch's scalar build
    interleaved: bool  # scalar build: rows 2j and 2j + 1 share a byte; vector builds: rows j and j + half

    @property
    def half(self) -> int:
        return self.block_rows // 2

    def order(self) -> torch.Tensor:
        """[block_rows]: the row within its block of nibble h of byte j, at h * half + j."""
        h, j = torch.arange(2).repeat_interleave(self.half), torch.arange(self.half).repeat(2)
        return 2 * j + h if self.interleaved else h * self.half + j

    def to_rows(self, y: torch.Tensor) -> torch.Tensor:
        """[..., nb * block_rows] in (block, nibble, byte) order -> the same in row order."""
        if not self.interleaved:
            return y
        lead = y.shape[:-1]
        return y.view(*lead, -1, 2, self.half).transpose(-1, -2).reshape(*lead, -1)

    def unpack(self, packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """packed [N, K / 2] -> codes [N, K] uint8."""
        blocks = packed.view(n // self.block_rows, k, self.half)
        return self.to_rows(torch.cat([blocks & 15, blocks >> 4], dim=2)).transpose(1, 2).reshape(n, k)


@functools.cache
def torch_int4_layout() -> Int4Layout:
    """Probed once per process: torch picks the layout by the vector ISA it dispatches to (the CPU, or
    ATEN_CPU_CAPABILITY), and both QuantLinear's dequantizing path and its scales must follow it."""
    convert, k = torch.ops.aten._convert_weight_to_int4pack_for_cpu, 32
    for rows in (16, 32, 64, 128):  # the first block's size: row `rows` is the first of the second block
        probe = torch.zeros(2 * rows, k, dtype=torch.int32)
        probe[rows, 0] = 1
        if convert(probe, 1).view(-1)[rows * k // 2] == 1:
            break
    probe = torch.zeros(rows, k, dtype=torch.int32)
    probe[1, 0] = 1
    layout = Int4Layout(rows, bool(convert(probe, 1).view(-1)[0] == 16))
    codes = torch.randint(0, 16, (2 * rows, k), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    if not torch.equal(layout.unpack(convert(codes, 1), 2 * rows, k), codes.to(torch.uint8)):
        raise RuntimeError(f"torch's CPU int4 layout is none pdserve reads (probed {layout})")
    return layout


def int4pack(codes: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """codes [N, K] (0..15) -> torch's CPU int4 layout [N, K / 2] uint8, `chunk` rows at a time (the op
    takes int32 codes: 4 bytes per weight at once would be the peak of a load)."""
    convert = torch.ops.aten._convert_weight_to_int4pack_for_cpu
    return torch.cat(
        [convert(codes[i : i + chunk].to(torch.int32), 1) for i in range(0, codes.shape[0], chunk)]
    )


class QuantLinear(nn.Module):
    """y = x @ w.T + bias for a quantized w [out, in]; `kernel` is "int4", "int8_split" or "int8_channel"."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, name: str = "") -> None:
        super().__init__()
        n, k = weight.codes.shape
        self.in_features, self.out_features = k, n
        self.bits, self.group_size = weight.bits, weight.group_size
        self.max_kernel_rows = MAX_KERNEL_ROWS
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        if weight.bits == 8 and weight.group_size == k and weight.is_symmetric:
            self.kernel = "int8_channel"
            self.register_buffer(
                "packed", (weight.codes.to(torch.int16) - 128).to(torch.int8).contiguous()
            )  # [N, K]
            self.register_buffer("kernel_scales", weight.scale[:, 0].to(torch.bfloat16))  # [N]
            self._exact_scales(weight)
            return
        self.kernel = "int4" if weight.bits == 4 else "int8_split"
        self.layout = torch_int4_layout()
        if weight.group_size not in (32, 64, 128, 256):
            raise ValueError(
                f"tensor {name!r}: group size {weight.group_size} is not one of 32, 64, 128, 256"
            )
        if pad := -n % self.layout.block_rows:  # zero rows up to torch's blocks; forward drops their outputs
            weight = QuantizedWeight(
                *(nn.functional.pad(t, (0, 0, 0, pad)) for t in (weight.codes, weight.scale, weight.offset)),
                weight.bits,
            )
        self._exact_scales(weight)
        s, z = weight.scale.t(), weight.offset.t()  # [G, N padded]
        if weight.bits == 4:
            self.register_buffer("packed", int4pack(weight.codes))
            planes = [(s, z + 8 * s)]
        else:
            hi, lo = weight.codes >> 4, weight.codes & 15
            self.register_buffer("packed", int4pack(torch.cat([hi, lo], dim=1)))  # [N, K] = [N, 2K / 2]
            planes = [(16 * s, torch.zeros_like(s)), (s, z + 136 * s)]
        # scales_and_zeros: [G (x2 planes), N, 2] bfloat16
        sz = torch.cat([torch.stack([scale, zero], dim=-1) for scale, zero in planes])
        self.register_buffer("kernel_scales", sz.to(torch.bfloat16).contiguous())

    def _exact_scales(self, weight: QuantizedWeight) -> None:
        # for the dequantizing path, float32: [N, 1] per channel; else [N / B, 2, G, 1, B / 2] for torch's
        # blocks of B rows, element [b, h, g, 0, j] for the row in nibble h of byte j of block b
        if self.kernel == "int8_channel":
            self.register_buffer("scale", weight.scale.contiguous())
            self.register_buffer("offset", weight.offset.contiguous())
            return
        (n, g), layout = weight.scale.shape, self.layout
        for name, t in (("scale", weight.scale), ("offset", weight.offset)):
            ordered = t.view(n // layout.block_rows, layout.block_rows, g)[:, layout.order()]
            blocked = ordered.view(-1, 2, layout.half, g).permute(0, 1, 3, 2).unsqueeze(3)
            self.register_buffer(name, blocked.contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= self.max_kernel_rows:
            y = self.kernel_mm(rows).to(x.dtype)[:, : self.out_features]
        else:
            y = self.dequant_mm(rows.float()).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def kernel_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """[M, K] -> [M, N (padded)] bfloat16."""
        xb = rows.to(torch.bfloat16)
        if self.kernel == "int8_channel":
            return torch._weight_int8pack_mm(xb, self.packed, self.kernel_scales)
        if self.kernel == "int8_split":
            xb = torch.cat([xb, xb], dim=1)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb, self.packed, self.group_size, self.kernel_scales
        )

    def dequant_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """[M, K] float32 -> [M, N] float32 through the exactly dequantized weight, DEQUANT_CHUNK rows
        at a time."""
        m, n = rows.shape[0], self.out_features
        if self.kernel == "int8_channel":
            return torch.cat(
                [rows @ self.dequantize(s, s + DEQUANT_CHUNK).t() for s in range(0, n, DEQUANT_CHUNK)], 1
            )
        step = DEQUANT_CHUNK // self.layout.block_rows
        outs = []
        for b0 in range(0, self.scale.shape[0], step):
            w = self._dequant_blocks(b0, min(b0 + step, self.scale.shape[0]))  # [nb * 2, K, B / 2]
            y = torch.matmul(rows, w).transpose(0, 1).reshape(m, -1)  # [nb * 2, M, B / 2] -> [M, nb * B]
            outs.append(self.layout.to_rows(y))
        return torch.cat(outs, 1)[:, :n]

    def _dequant_blocks(self, b0: int, b1: int) -> torch.Tensor:
        """Row blocks b0:b1 of torch's layout as float32 [(b1 - b0) * 2, K, B / 2], a workspace view:
        [2 b + h, k, j] is column k of the row in nibble h of byte j of block b."""
        k, nb, g, half = self.in_features, b1 - b0, self.scale.shape[2], self.layout.half
        codes = _scratch("codes", (nb, 2, k, half), torch.uint8)
        blocks = self.packed[b0 * self.layout.block_rows : b1 * self.layout.block_rows]
        if self.kernel == "int4":
            blocks = blocks.view(nb, k, half)
            torch.bitwise_and(blocks, 15, out=codes[:, 0])
            torch.bitwise_right_shift(blocks, 4, out=codes[:, 1])
        else:  # planes along K: high nibbles of the 8-bit codes, then low nibbles
            blocks = blocks.view(nb, 2 * k, half)
            high, low = blocks[:, :k], blocks[:, k:]
            torch.bitwise_left_shift(high, 4, out=codes[:, 0]).bitwise_or_(low & 15)
            torch.bitwise_and(high, 0xF0, out=codes[:, 1]).bitwise_or_(low >> 4)
        shape = (nb, 2, g, k // g, half)
        floats = _scratch("floats", shape, torch.float32).copy_(codes.view(shape))
        weights = _scratch("weights", shape, torch.float32)
        torch.addcmul(self.offset[b0:b1], floats, self.scale[b0:b1], out=weights)
        return weights.view(nb * 2, k, half)

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Output rows start:end as float32 [end - start, K]: exactly codes * scale + offset."""
        end = min(end or self.out_features, self.out_features)
        if self.kernel == "int8_channel":
            return torch.addcmul(
                self.offset[start:end], self.packed[start:end].float() + 128, self.scale[start:end]
            )
        rows = self.layout.block_rows
        b0, b1 = start // rows, math.ceil(end / rows)
        w = self.layout.to_rows(self._dequant_blocks(b0, b1).transpose(0, 1).reshape(self.in_features, -1)).t()
        return w[start - b0 * rows : end - b0 * rows].clone()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers()) + (
            self.bias.numel() * self.bias.element_size() if self.bias is not None else 0
        )

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}, group={self.group_size}"
        )


class QuantEmbedding(nn.Module):
    """Rows of a quantized [V, H] table, dequantized exactly on lookup."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = weight.codes.shape
        self.register_buffer("codes", weight.codes.contiguous())  # [V, H] uint8
        self.register_buffer("scale", weight.scale.contiguous())  # [V, G]
        self.register_buffer("offset", weight.offset.contiguous())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, H]
        g = self.scale.shape[1]
        codes = self.codes_of(input_ids.reshape(-1)).view(-1, g, self.embedding_dim // g).float()
        scale, offset = self.scale[input_ids].float(), self.offset[input_ids].float()
        rows = torch.addcmul(offset.view(-1, g, 1), codes, scale.view(-1, g, 1))
        return rows.view(*input_ids.shape, self.embedding_dim).to(self.dtype)

    def codes_of(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, H] uint8, in element order
        return self.codes[ids]
