"""The native float32 RMSNorm and rotary embedding (pdserve.kernels.cpu_layers) against torch's ops, as the
decoder calls them (under inference mode), and the inputs they leave to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_layers import rms_norm, rotary
from pdserve.models.config import RopeConfig
from pdserve.models.llama import RMSNorm
from pdserve.models.rotary import RotaryEmbedding, _rotate

if cpu_native.library() is None:
    pytest.skip(f"native kernels not built: {cpu_native.unavailable_reason()}", allow_module_level=True)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_is_within_float32_rounding_of_torchs(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 576, generator=gen) * 3, torch.randn(576, generator=gen)
    with torch.inference_mode():
        out = rms_norm(x, weight, 1e-5)
        reference = F.rms_norm(x, (576,), weight, 1e-5)
    assert out is not None and (out - reference).abs().max() <= 4e-6 * reference.abs().max()


def test_the_decoders_norm_takes_the_native_path_only_in_inference() -> None:
    norm = RMSNorm(64, 1e-6)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        assert rms_norm(x, norm.weight, norm.eps) is not None
        assert torch.allclose(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-6), atol=1e-6)
    assert rms_norm(x, norm.weight, norm.eps) is None  # autograd on: torch's op
    with torch.inference_mode():
        assert rms_norm(x.double(), norm.weight, norm.eps) is None
        assert rms_norm(x.t(), norm.weight, norm.eps) is None


def test_rotary_is_bit_identical_to_torchs_on_strided_heads() -> None:
    rope = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim=64, max_positions=512)
    qkv = torch.randn(5, 9 * 64 + 2 * 3 * 64)
    q = qkv[:, : 9 * 64].view(5, 9, 64)
    k = qkv[:, 9 * 64: 12 * 64].view(5, 3, 64)
    positions = torch.tensor([0, 1, 77, 300, 511])
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    with torch.inference_mode():
        out_q, out_k = rope(positions, q, k)
        assert torch.equal(out_q, _rotate(q, cos, sin)) and torch.equal(out_k, _rotate(k, cos, sin))
        assert torch.equal(rotary(q, positions, rope.cos, rope.sin), _rotate(q, cos, sin))
        with pytest.raises(IndexError, match="rotary"):
            rotary(q, torch.tensor([0, 1, 2, 3, 512]), rope.cos, rope.sin)
        assert rotary(q, positions.int(), rope.cos, rope.sin) is None  # torch's path gathers int32 positions
        assert rotary(q.transpose(1, 2), positions, rope.cos, rope.sin) is None
