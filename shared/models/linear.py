"""Linear layers (weights stored [in, out]) and their CPU weight packing.

On CPU, MKL's sgemm is slow at a few rows (a decode verifying a draft, a small decode batch) on the
AMD EPYC machines pdserve is developed on: SmolLM2-135M's linears take 31 ms for 1 row, 95 ms for 9
and 108 ms for 16 (`pdserve bench linears`). oneDNN's inner product over a weight reordered once into its blocked layout takes
38 and 52 ms for 9 and 16 rows, but 36 ms for 1 row, where MKL's GEMV streams the plain weight
faster. So a packed layer keeps both: one row goes through the plain weight, more through the packed
one. That doubles the weights' memory; `EngineConfig.pack_weights=False` turns packing off. Only CPU
layers in float32 (or bfloat16 where oneDNN supports it) are packed.
"""

from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Module):
    """y = x @ weight + bias with weight stored [in, out]: on CPU, streaming a transposed
    weight through matmul reads memory ~25% faster at batch 1 than F.linear's [out, in]."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # the weight in oneDNN's blocked layout, for 2+ rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.numel() > self.in_features:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x, self.weight) if x.dim() == 2 else x @ self.weight + self.bias

    def pack(self) -> None:
        """Reorder a copy of the weight for oneDNN (inference only: no gradient flows through it)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().t().contiguous(), None)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linears(model: nn.Module) -> int:
    """Pack every Linear of a CPU model whose dtype oneDNN supports; returns how many were packed."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.packed is None]
    if not all(can_pack(m.weight.device, m.weight.dtype) for m in linears):
        return 0
    for module in linears:
        module.pack()
    return len(linears)
