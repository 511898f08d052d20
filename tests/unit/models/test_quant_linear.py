"""Weight-only quantized linears against gguf's own dequantization, on small random blocks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from pdserve.config import QUANTIZATIONS as CONFIG_QUANTIZATIONS
from pdserve.config import EngineConfig
from pdserve.models.quant_linear import QuantEmbedding, QuantLinear, int4pack, torch_int4_layout
from pdserve.models.quantization import (
    QUANTIZATIONS,
    from_gguf_blocks,
    quantize_rtn,
    quantize_rtn_symmetric,
    target_bits,
)

Q = gguf.GGMLQuantizationType
BLOCK_TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def _gguf_weight(type_name: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Raw blocks [rows, cols / 32 * block bytes] and gguf's float32 dequantization [rows, cols]."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05 + rng.uniform(-0.02, 0.02, (rows, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, Q[type_name])
    return raw, gguf.quants.dequantize(raw, Q[type_name]).astype(np.float32).reshape(rows, cols)


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
def test_blocks_read_as_gguf_dequantizes_them(type_name: str) -> None:
    raw, expected = _gguf_weight(type_name, 5, 96)
    weight = from_gguf_blocks(raw, type_name, "t")
    assert weight.bits == (8 if type_name == "Q8_0" else 4) and weight.group_size == 32
    assert int(weight.codes.max()) < 2**weight.bits
    np.testing.assert_array_equal(weight.dequantize().numpy(), expected)
    np.testing.assert_allclose(weight.widened().dequantize().numpy(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [64, 192])
def test_the_probed_layout_reads_torchs_int4_packing_back(n: int) -> None:
    """The layout QuantLinear's dequantizing path reads, probed from torch in this process."""
    codes = torch.randint(0, 16, (n, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    assert torch.equal(torch_int4_layout().unpack(int4pack(codes), n, 96), codes)


LAYOUT_CHECK = textwrap.dedent("""
    import torch
    from pdserve.models.quant_linear import Int4Layout, QuantLinear, torch_int4_layout
    from pdserve.models.quantization import quantize_rtn
    expected = {"DEFAULT": Int4Layout(32, True), "AVX2": Int4Layout(32, False), "AVX512": Int4Layout(64, False)}
    capability = torch.backends.cpu.get_cpu_capability()
    assert torch_int4_layout() == expected[capability], (capability, torch_int4_layout())
    gen = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        weight = quantize_rtn(torch.randn(100, 64, generator=gen) * 0.1, bits, 32, "t")
        linear, reference = QuantLinear(weight, None, "t"), weight.dequantize()
        assert torch.equal(linear.dequantize(), reference)
        assert torch.equal(linear.dequantize(40, 90), reference[40:90])
        x = torch.randn(linear.max_kernel_rows + 3, 64, generator=gen)
        torch.testing.assert_close(linear(x), x @ reference.t(), rtol=1e-5, atol=1e-5)
        few = x[:2]
        error = (linear(few) - few @ reference.t()).abs().max() / (few @ reference.t()).abs().max()
        assert error < 1e-2, error
    print(capability)
""")


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_quant_linear_follows_torchs_layout_under_each_cpu_capability(capability: str) -> None:
    """Torch packs int4 weights in blocks of 64 rows under AVX-512, 32 under AVX2 and 32 interleaved in its
    scalar build. ATEN_CPU_CAPABILITY picks the build; one above the CPU's would die of an illegal instruction."""
    levels = ["default", "avx2", "avx512"]
    native = torch.backends.cpu.get_cpu_capability().lower()
    if native not in levels or levels.index(capability) > levels.index(native):
        pytest.skip(f"this CPU runs torch's {native} build")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-c", LAYOUT_CHECK], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_torch_int4_cpu_kernel_dequantizes_as_q_minus_8_times_scale_plus_zero() -> None:
    """The invariant QuantLinear's zeros rely on: torch's int4 CPU mm computes w = (q - 8) * scale + zero."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 64), dtype=torch.int32, generator=gen)
    scale, zero = torch.rand(2, 64, generator=gen) + 0.5, torch.randn(2, 64, generator=gen)  # [G, N]
    sz = torch.stack([scale, zero], dim=-1).to(torch.bfloat16)
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4pack(codes), 32, sz).float()
    s, z = (t.to(torch.bfloat16).float().repeat_interleave(32, 0) for t in (scale, zero))  # [K, N]
    w = (codes.t().float() - 8) * s + z
    torch.testing.assert_close(y, x.float() @ w, rtol=1e-2, atol=0.05)
    assert (y - x.float() @ (codes.t().float() * s + z)).abs().max() > 10  # the other formula is far off


@pytest.mark.parametrize("type_name", BLOCK_TYPES)
@pytest.mark.parametrize("widen", [False, True])
def test_quant_linear_matches_the_dequantized_weight(type_name: str, widen: bool) -> None:
    raw, expected = _gguf_weight(type_name, 128, 96)
    weight = from_gguf_blocks(raw, type_name, "t")
    linear = QuantLinear(weight.widened() if widen else weight, None, "t")
    assert linear.kernel == ("int8_split" if widen or type_name == "Q8_0" else "int4")
    reference = torch.from_numpy(expected).t()  # [K, N]
    torch.testing.assert_close(linear.dequantize().t(), reference, rtol=1e-6, atol=1e-7)
    gen = torch.Generator().manual_seed(1)
    many = torch.randn(linear.max_kernel_rows + 5, 96, generator=gen)  # exact float32 path
    torch.testing.assert_close(linear(many), many @ reference, rtol=1e-5, atol=1e-5)
    few = torch.randn(3, 96, generator=gen)  # bfloat16 kernel path: input, scales and output rounded
    error = (linear(few) - few @ reference).abs().max() / (few @ reference).abs().max()
    assert error < 1e-2


def test_quant_linear_pads_rows_to_torch_blocks_and_keeps_bias() -> None:
    raw, expected = _gguf_weight("Q4_1", 100, 64)
    bias = torch.randn(100)
    linear = QuantLinear(from_gguf_blocks(raw, "Q4_1", "t"), bias, "t")
    x = torch.randn(40, 64)
    y = linear(x)
    assert y.shape == (40, 100)
    torch.testing.assert_close(y, x @ torch.from_numpy(expected).t() + bias, rtol=1e-5, atol=1e-5)
    assert linear(x[:2]).shape == (2, 100)


def test_round_to_nearest_bounds_and_kernels() -> None:
    w = torch.randn(64, 96) * 0.1
    int4 = quantize_rtn(w, 4, 32, "t")
    err = (int4.dequantize() - w).abs().view(64, 3, 32).amax(-1)
    assert (err <= int4.scale / 2 * (1 + 1e-5) + 1e-7).all()
    assert QuantLinear(int4, None, "t").kernel == "int4"
    int8 = quantize_rtn_symmetric(w, "t")
    assert int8.is_symmetric and int8.group_size == 96
    assert (int8.dequantize() - w).abs().max() <= int8.scale.max() / 2 * (1 + 1e-5)
    linear = QuantLinear(int8, None, "t")
    assert linear.kernel == "int8_channel"
    torch.testing.assert_close(linear.dequantize(), int8.dequantize())
    x = torch.randn(2, 96)
    assert ((linear(x) - x @ int8.dequantize().t()).abs().max() / (x @ w.t()).abs().max()) < 1e-2


def test_embedding_rows_are_the_dequantized_rows() -> None:
    raw, expected = _gguf_weight("Q8_0", 10, 64)
    table = QuantEmbedding(from_gguf_blocks(raw, "Q8_0", "e"))
    ids = torch.tensor([3, 0, 9, 3])
    np.testing.assert_array_equal(table(ids).numpy(), expected[ids.numpy()])


def test_refusals_name_the_tensor_and_reason() -> None:
    with pytest.raises(
        ValueError, match=r"'w': in_features 40 is not a multiple of the quantization group 32"
    ):
        quantize_rtn(torch.randn(64, 40), 4, 32, "w")
    with pytest.raises(ValueError, match=r"'x': GGUF type Q5_0 has no quantized linear"):
        from_gguf_blocks(np.zeros((1, 22), np.uint8), "Q5_0", "x")
    with pytest.raises(ValueError, match="fp8.*GPU"):
        target_bits("fp8", "F32")
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="tiny", device="cpu", quantization="int3")
    assert CONFIG_QUANTIZATIONS == QUANTIZATIONS and EngineConfig().quantization == "none"


@pytest.mark.parametrize(
    ("mode", "source", "head", "bits"),
    [
        ("none", "Q4_1", False, None),
        ("auto", "Q4_1", False, 4),
        ("auto", "Q8_0", True, 8),
        ("auto", "F16", False, None),
        ("int8", "Q4_0", False, 8),
        ("int8", "F32", False, 8),
        ("int4", "Q8_0", False, 4),
        ("int4", "Q8_0", True, 8),
        ("int4", "F32", True, 8),
        ("int4", "Q4_0", True, 4),
    ],
)
def test_target_bits(mode: str, source: str, head: bool, bits: int | None) -> None:
    assert target_bits(mode, source, is_lm_head=head) == bits
