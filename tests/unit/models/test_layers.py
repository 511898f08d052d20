"""The decoder's small layers against their plain formulas: RMSNorm's fused float32 path is bit-identical to
HF's steps, and the rotary embedding gathers cos/sin once per positions tensor and never serves stale ones."""

from __future__ import annotations

import torch

from pdserve.models.config import RopeConfig
from pdserve.models.llama import RMSNorm
from pdserve.models.rotary import RotaryEmbedding, _rotate


def _hf_rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * h.to(dtype)


def test_rms_norm_float32_is_bit_identical_to_the_hf_steps():
    torch.manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576)
    for rows in (1, 7, 300):
        x = torch.randn(rows, 576) * 3
        assert torch.equal(norm(x), _hf_rms_norm(norm, x))
    xb = torch.randn(5, 576, dtype=torch.bfloat16)
    assert torch.equal(norm(xb), _hf_rms_norm(norm, xb))


def test_rotary_gathers_once_per_positions_tensor_and_follows_new_positions():
    torch.manual_seed(0)
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim=64, max_positions=128)

    def direct(positions, x):
        return _rotate(x, rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1))

    q, k = torch.randn(3, 9, 64), torch.randn(3, 3, 64)
    first = torch.tensor([0, 5, 17])
    with torch.inference_mode():
        out_q, out_k = rope(first, q, k)
        gathered = rope._gathered
        rope(first, q, k)  # the next layer of the same pass
        assert rope._gathered is gathered
        assert torch.equal(out_q, direct(first, q)) and torch.equal(out_k, direct(first, k))
        second = torch.tensor([1, 6, 18])  # the next step: new values, new tensor
        out_q, _ = rope(second, q, k)
        assert torch.equal(out_q, direct(second, q)) and not torch.equal(out_q, direct(first, q))
