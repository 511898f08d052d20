"""Rotary position embedding (HF non-interleaved layout), with llama3 and linear scaling."""

from __future__ import annotations

import math

import torch

from pdserve.kernels import cpu_layers
from pdserve.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        # computed on the context's device; under meta on the host (meta math pulls in torch's decompositions,
        # seconds of imports), then placed on meta
        device = torch.get_default_device()
        compute = torch.device("cpu") if device.type == "meta" else device
        inv_freq = inverse_frequencies(rope, head_dim, compute)
        freqs = torch.arange(max_positions, dtype=torch.float32, device=compute)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        # cos, sin: [max_positions, head_dim], float32
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)
        self._gathered: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, D]; k: [T, Hkv, D]
        if q.dtype is torch.float32:  # the native kernel, bit-identical to _rotate
            rotated_q = cpu_layers.rotary(q, positions, self.cos, self.sin)
            rotated_k = cpu_layers.rotary(k, positions, self.cos, self.sin)
            if rotated_q is not None and rotated_k is not None:
                return rotated_q, rotated_k
        cos, sin = self._cos_sin(positions, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, D] at `positions`. Every layer of a forward pass is handed the same positions
        tensor (one module serves them all): gathered once per pass. Holding the tensor keeps another from
        taking its address; nothing writes positions in place (the runner builds them anew each step)."""
        cached = self._gathered
        if cached is None or cached[0] is not positions or cached[1] != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)
            sin = self.sin[positions].unsqueeze(1).to(dtype)
            self._gathered = cached = (positions, dtype, cos, sin)
        return cached[2], cached[3]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
