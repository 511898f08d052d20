"""Weight-only quantization formats: GGUF blocks read as they are stored, and round-to-nearest at load.

A quantized weight is unsigned integer codes with group-wise scales and offsets (HF's [out, in] order):

    w[n, k] = codes[n, k] * scale[n, k // group] + offset[n, k // group]

GGUF blocks map onto it exactly (d and m are the file's float16 values):
    Q4_0: w = (q - 8) * d   -> codes = q,       scale = d, offset = -8 d
    Q4_1: w = q * d + m     -> codes = q,       scale = d, offset = m
    Q8_0: w = q * d (q: s8) -> codes = q + 128, scale = d, offset = -128 d
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")
GROUP_SIZE = 32  # elements per GGUF block, and the group of round-to-nearest int4
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # float16 d [, float16 m], then the codes
BLOCK_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor  # [N, K] uint8, values < 2**bits
    scale: torch.Tensor  # [N, K // group] float32
    offset: torch.Tensor  # [N, K // group] float32
    bits: int

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    @property
    def is_symmetric(self) -> bool:
        """offset == -2**(bits-1) * scale: signed codes times a scale (Q8_0, int8 per channel)."""
        return bool(torch.equal(self.offset, -(2 ** (self.bits - 1)) * self.scale))

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32, exactly codes * scale + offset per group."""
        n, k = self.codes.shape
        groups = self.codes.view(n, -1, self.group_size).float()
        return torch.addcmul(self.offset[:, :, None], groups, self.scale[:, :, None]).view(n, k)

    def widened(self) -> QuantizedWeight:
        """The same weights as 8-bit codes: 4-bit code q is 17 q (0..255), with scale / 17."""
        if self.bits == 8:
            return self
        return QuantizedWeight(self.codes * 17, self.scale / 17, self.offset, 8)


def concat(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack along N (fused q/k/v or gate/up); parts of 4 and 8 bits are all served at 8 (exact)."""
    if len({p.group_size for p in parts}) > 1:
        raise ValueError(f"fused parts have different group sizes {[p.group_size for p in parts]}")
    if len({p.bits for p in parts}) > 1:
        parts = [p.widened() for p in parts]
    return QuantizedWeight(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.offset for p in parts]),
        parts[0].bits,
    )


def from_gguf_blocks(raw: np.ndarray, qtype: str, name: str) -> QuantizedWeight:
    """raw: [N, K / 32 * block bytes] uint8, a GGUF tensor's rows as stored (Q4_0, Q4_1 or Q8_0)."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(
            f"tensor {name!r}: GGUF type {qtype} has no quantized linear (read: {sorted(BLOCK_BYTES)})"
        )
    nbytes = BLOCK_BYTES[qtype]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, nbytes)  # [N, G, block bytes]
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)  # [N, G]
    if qtype == "Q8_0":
        codes = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [N, G, 32]
        offset = -128 * d
    else:
        nibbles = blocks[:, :, nbytes - 16 :]  # byte j: element j (low nibble), element j + 16 (high)
        codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=2)
        offset = (
            blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
            if qtype == "Q4_1"
            else -8 * d
        )
    return QuantizedWeight(
        torch.from_numpy(codes.reshape(rows, -1)),
        torch.from_numpy(d),
        torch.from_numpy(offset),
        BLOCK_BITS[qtype],
    )


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int, name: str) -> QuantizedWeight:
    """Round to nearest over [N, K] with group-wise min/max (asymmetric): codes span [0, 2**bits - 1]."""
    n, k = weight.shape
    check_group(name, k, group_size)
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / (2**bits - 1)).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.round((groups - low[:, :, None]) / scale[:, :, None]).clamp_(0, 2**bits - 1)
    return QuantizedWeight(codes.to(torch.uint8).reshape(n, k), scale, low, bits)


def quantize_rtn_symmetric(weight: torch.Tensor, name: str) -> QuantizedWeight:
    """int8 per output channel (group = K), symmetric: what `torch._weight_int8pack_mm` takes."""
    w = weight.detach().float()
    scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # [N, 1]
    signed = torch.round(w / scale).clamp_(-127, 127)
    return QuantizedWeight((signed + 128).to(torch.uint8), scale, -128 * scale, 8)


def check_group(name: str, in_features: int, group_size: int) -> None:
    if in_features % group_size:
        raise ValueError(
            f"tensor {name!r}: in_features {in_features} is not a multiple of the quantization group "
            f"{group_size}"
        )


def target_bits(mode: str, source_type: str, is_lm_head: bool = False) -> int | None:
    """Bits a linear weight stored as `source_type` is served at under `mode` (None: float, as today).

    auto: GGUF blocks as stored (Q4_x at 4 bits, Q8_0 at 8), float weights unquantized.
    int4: every linear at 4 bits (Q4_x as stored; Q8_0 and float weights round-to-nearest, group 32),
          but the LM head, which is never taken below its stored bits or 8 (SmolLM2's Q8_0 head rounded
          to int4 costs 6.7% perplexity).
    int8: every linear at 8 bits (Q8_0 as stored; Q4_x widened exactly; float weights per channel).
    """
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")
    if mode == "none":
        return None
    if mode == "fp8":
        raise ValueError("quantization 'fp8': FP8 weights need a GPU with FP8; pdserve serves them on no CPU")
    if source_type not in BLOCK_BITS and source_type not in FLOAT_TYPES:
        raise ValueError(
            f"GGUF type {source_type} cannot be served (read: {sorted(BLOCK_BITS) + list(FLOAT_TYPES)})"
        )
    if mode == "auto":
        return BLOCK_BITS.get(source_type)
    if mode == "int4" and is_lm_head:
        return BLOCK_BITS.get(source_type, 8)
    return 4 if mode == "int4" else 8
