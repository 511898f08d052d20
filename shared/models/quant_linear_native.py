"""Weight-only quantized linears on CPU through pdserve's native kernel (pdserve.kernels.cpu_quant).

One copy of the weight: the codes in the kernel's packed layout (int4: half a byte a weight) and the group
scales and offsets, float16 where exact (GGUF's: Q4_1 is then 20 bytes per 32 weights, as in the file).
Up to `max_kernel_rows` rows (`native_max_kernel_rows`: a decode step, and prefills up to that many tokens) the
kernel multiplies them with float32 input directly; above it the weight is dequantized exactly to float32,
DEQUANT_CHUNK output rows at a time, for a float32 matmul.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.kernels import cpu_quant
from pdserve.models.quant_linear import DEQUANT_CHUNK, QuantEmbedding, QuantLinear, _scratch
from pdserve.models.quantization import QuantizedWeight

# rows up to which the kernel serves: at one thread (the default model's shapes, AMD EPYC) it ran 1.2-1.6x the
# dequantize-and-matmul path at 64-128 rows, 1.06-1.25x at 512, 1.03-1.32x at 1,024, 0.95-1.31x at 2,048
NATIVE_MAX_KERNEL_ROWS = 1024
# without AVX-512 VNNI, above a few rows (the AVX2 kernel's int8 GEMV, quant_gemm.c) the float32 path serves,
# which reads x once per output channel: on AVX2 (2-core AMD EPYC, 2 threads, the default model's four shapes)
# it took 0.3x the dequantize-and-matmul time at 1-4 rows, 0.88x at 16, 1.1x at 24
NATIVE_F32_MAX_KERNEL_ROWS = 16


def native_max_kernel_rows(kernel: str) -> int:
    """Rows up to which `kernel` ("native-vnni", "native-avx2" or "native-f32") serves."""
    return NATIVE_MAX_KERNEL_ROWS if kernel == "native-vnni" else NATIVE_F32_MAX_KERNEL_ROWS


def native_kernel_takes(weight: QuantizedWeight) -> bool:
    """The native kernel is built here and the shape fits its layout (K a multiple of 64, groups of
    32-element blocks)."""
    return (
        cpu_quant.library() is not None and cpu_quant.takes(weight.codes.shape[1], weight.group_size)
        and weight.bits in (4, 8)
    )


class NativeQuantLinear(nn.Module):
    """y = x @ w.T + bias for a quantized w [out, in]; `kernel` is "native-vnni", "native-avx2" or
    "native-f32"."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        scale, offset = cpu_quant.scales(weight.scale, weight.offset)
        self._build(cpu_quant.pack(weight.codes, weight.bits), scale, offset, weight.bits, weight.codes.shape[1],
                    bias)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                    in_features: int, bias: torch.Tensor | None = None) -> NativeQuantLinear:
        """Over buffers already in the kernel's layout (pdserve.models.packed_cache), not copied."""
        module = cls.__new__(cls)
        module._build(packed, scale, offset, bits, in_features, bias)
        return module

    def _build(self, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, k: int,
               bias: torch.Tensor | None) -> None:
        nn.Module.__init__(self)
        self.lib = cpu_quant.library()
        if self.lib is None:
            raise RuntimeError(f"native CPU quantized kernel unavailable: {cpu_quant.unavailable_reason()}")
        n, groups = scale.shape
        self.in_features, self.out_features = k, n
        self.bits, self.group_size = bits, k // groups
        self.kernel = f"native-{cpu_quant.isa(self.lib)}"
        self.max_kernel_rows = native_max_kernel_rows(self.kernel)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.register_buffer("packed", packed)  # [N, K] (8 bits) or [N, K / 2] (4 bits) uint8
        self.register_buffer("scale", scale)  # [N, K / group] float16 (when exact) or float32
        self.register_buffer("offset", offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]; a decode step calls this ~120 times: no op that is not needed
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if rows.dtype is not torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        if rows.shape[0] <= self.max_kernel_rows:
            y = cpu_quant.quant_gemm(self.lib, rows, self.packed, self.bits, self.scale, self.offset)
        else:
            y = torch.cat(
                [rows @ self.dequantize_into(s, min(s + DEQUANT_CHUNK, self.out_features)).t()
                 for s in range(0, self.out_features, DEQUANT_CHUNK)], 1)
        if self.bias is not None:
            y = y + self.bias
        if x.dtype is not torch.float32:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def dequantize_into(self, start: int, end: int) -> torch.Tensor:
        """Rows start:end as float32 [end - start, K] in a reused buffer."""
        out = _scratch("native", (end - start, self.in_features), torch.float32)
        return cpu_quant.quant_dequant(self.lib, self.packed, self.bits, self.scale, self.offset, start, end, out)

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Output rows start:end as float32 [end - start, K]: exactly codes * scale + offset."""
        end = min(end or self.out_features, self.out_features)
        return self.dequantize_into(start, end).clone()

    nbytes = QuantLinear.nbytes  # every buffer and the bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}, bits={self.bits}"


class TiedQuantEmbedding(QuantEmbedding):
    """The embedding table read from a tied int8 LM head's packed codes and its scales: one copy of the
    [V, H] table (the file stores it once), rows dequantized exactly as QuantEmbedding's."""

    def __init__(self, head: NativeQuantLinear, dtype: torch.dtype = torch.float32) -> None:
        nn.Module.__init__(self)  # no codes of its own: the buffers below are the head's tensors
        if head.bits != 8:
            raise ValueError(f"a tied embedding reads int8 codes, the LM head has int{head.bits}")
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.register_buffer("packed", head.packed, persistent=False)  # [V, H] uint8, the kernel's order
        self.register_buffer("scale", head.scale, persistent=False)  # [V, G] float16 or float32
        self.register_buffer("offset", head.offset, persistent=False)

    def codes_of(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, H] uint8. Position (a, b, j) of a packed 64-code block holds element (b, a, j)
        # (cpu_quant.pack_order: a < 8, b < 2, j < 4)
        blocks = self.packed[ids].view(-1, self.embedding_dim // cpu_quant.PAIR, 8, 2, 4)
        return blocks.transpose(2, 3).reshape(-1, self.embedding_dim)
