"""pdserve's native CPU kernel for weight-only quantized linears (pdserve.kernels.cpu_quant), built here with
the system compiler as users' processes build it: the packed layout round-trips exactly, the GEMM matches
a float64 reference at every tile shape, on the AVX-512 VNNI build, the AVX2 one and the generic one (the
float32 path in plain C)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pdserve.kernels import cpu_quant
from pdserve.models.quant_linear import QuantLinear
from pdserve.models.quant_linear_cuda import quant_linear_for
from pdserve.models.quant_linear_native import NativeQuantLinear
from pdserve.models.quantization import QuantizedWeight, quantize_rtn, quantize_rtn_symmetric

if cpu_quant.library() is None:
    pytest.skip(f"native kernel not built: {cpu_quant.unavailable_reason()}", allow_module_level=True)

PORTABLE = cpu_quant.FLAGS + ("-mno-avx512f",)  # the AVX2 path where the CPU has AVX2, FMA and F16C
GENERIC = PORTABLE + ("-mno-avx2",)  # the float32 path in plain C, as on CPUs without AVX2
BUILDS = {"native": cpu_quant.FLAGS, "portable": PORTABLE, "generic": GENERIC}


def _weight(n: int, k: int, bits: int, seed: int, group: int = 32) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    q = quantize_rtn(torch.randn(n, k, generator=gen) * 0.05, bits, group, "w")
    # GGUF's scales are float16: code * scale is then exact in float32, as the kernel's dequantization
    return QuantizedWeight(q.codes, q.scale.half().float(), q.offset.half().float(), bits)


def _lib(build: str):
    lib = cpu_quant._load(BUILDS[build])[0]
    assert lib is not None, cpu_quant._load(BUILDS[build])[1]
    return lib


def test_the_builds_report_their_instruction_sets() -> None:
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split()
    avx2 = "avx2" if {"avx2", "fma", "f16c"} <= set(flags) else "f32"
    assert cpu_quant.isa(_lib("generic")) == "f32" and cpu_quant.isa(_lib("portable")) == avx2
    assert cpu_quant.isa(_lib("native")) == ("vnni" if {"avx512bw", "avx512_vnni"} <= set(flags) else avx2)


def test_pack_order_is_a_permutation_with_one_block_per_lane() -> None:
    order = cpu_quant.pack_order()
    assert sorted(order.tolist()) == list(range(64))
    lanes = order.view(16, 4) // 32  # each 4-byte lane reads one 32-element block, alternating
    assert torch.equal(lanes, (torch.arange(16) % 2)[:, None].expand(16, 4))


SCALES = {  # float32 as given, or float16 where exact (GGUF's d and m)
    "float32": lambda w: (w.scale, w.offset),
    "float16": lambda w: cpu_quant.scales(w.scale, w.offset),
}


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize(("k", "bits", "group"), [(128, 4, 32), (192, 4, 32), (64, 4, 32), (192, 8, 32),
                                                  (576, 8, 32), (256, 4, 64), (384, 8, 128)])
def test_dequantize_is_exact(build: str, scales: str, k: int, bits: int, group: int) -> None:
    """K % 128 == 64 leaves a last int4 pair stored alone: both layouts are checked."""
    w = _weight(37, k, bits, k + bits, group)
    scale, offset = SCALES[scales](w)
    assert scale.dtype == getattr(torch, scales)
    packed = cpu_quant.pack(w.codes, bits)
    assert packed.shape == (37, k // 2 if bits == 4 else k)
    out = torch.empty(30, k)
    cpu_quant.quant_dequant(_lib(build), packed, bits, scale, offset, 5, 35, out)
    assert torch.equal(out, w.dequantize()[5:35])


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 32), (4, 64), (8, 192)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17, 32])
def test_gemm_matches_float64(build: str, scales: str, bits: int, group: int, rows: int) -> None:
    """N = 67: a remainder after the 4-channel tiles of one row; rows > 8: several 8-row tiles."""
    w = _weight(67, 192, bits, rows, group)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)) * 3
    x[0, :32] *= 100  # an outlier block: the int8 planes scale per 32-element block
    ref = x.double() @ w.dequantize().double().t()
    y = cpu_quant.quant_gemm(_lib(build), x, cpu_quant.pack(w.codes, bits), bits, *SCALES[scales](w))
    rel = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel < (1e-6 if cpu_quant.isa(_lib(build)) == "f32" else 2e-4), rel


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("k", "rows"), [(576, 1), (576, 3), (640, 2), (640, 9)])
def test_gemm_matches_float64_over_long_rows(build: str, bits: int, k: int, rows: int) -> None:
    """Rows of 18 and 20 scale groups: the offsets' term by 8 groups at a time and a remainder; K = 576 ends
    in an int4 pair stored alone; 2, 3 and 9 rows: row by row, and the float32 path above it (AVX2)."""
    w = _weight(37, k, bits, k + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) + 0.5  # sums of x do not cancel
    ref = x.double() @ w.dequantize().double().t()
    y = cpu_quant.quant_gemm(_lib(build), x, cpu_quant.pack(w.codes, bits), bits, *cpu_quant.scales(w.scale, w.offset))
    rel = ((y.double() - ref).abs().max() / ref.abs().max()).item()
    assert rel < (1e-6 if cpu_quant.isa(_lib(build)) == "f32" else 2e-4), rel


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("bits", [4, 8])
def test_extreme_codes_against_full_scale_input_do_not_saturate(build: str, bits: int) -> None:
    """Every code 0 or the largest against x at +-max|x| (the int8 planes' +-127): the int16 pair sums of
    vpmaddubsw stay in range (8-bit codes go as c - 128: |-128 * 127| * 2 < 2^15)."""
    top = 2**bits - 1
    codes = torch.tensor([[0] * 64, [top] * 64, [0, top] * 32, [top, 0] * 32], dtype=torch.uint8).repeat(2, 2)
    w = QuantizedWeight(codes, torch.full((8, 4), 0.5), torch.full((8, 4), -1.0), bits)
    x = torch.tensor([[3.0] * 128, [-3.0] * 128, [3.0, -3.0] * 64])
    ref = x.double() @ w.dequantize().double().t()
    packed = cpu_quant.pack(w.codes, bits)
    y = torch.cat([cpu_quant.quant_gemm(_lib(build), row[None], packed, bits, w.scale, w.offset) for row in x])
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6


def test_zero_input_gives_the_zero_output() -> None:
    w = _weight(8, 64, 4, 0)
    y = cpu_quant.quant_gemm(_lib("native"), torch.zeros(2, 64), cpu_quant.pack(w.codes, 4), 4, w.scale,
                             w.offset)
    assert torch.equal(y, torch.zeros(2, 8))


@pytest.mark.parametrize("rows", [1, 3, 40, 1100])
def test_native_quant_linear_decode_and_prefill_paths(rows: int) -> None:
    """Up to max_kernel_rows the kernel, above it the exact dequantized float32 weight."""
    gen = torch.Generator().manual_seed(rows)
    weight = quantize_rtn_symmetric(torch.randn(96, 128, generator=gen), "w")  # int8 per channel
    bias = torch.randn(96, generator=gen)
    layer = quant_linear_for(weight, bias, "w", "cpu")
    assert isinstance(layer, NativeQuantLinear) and layer.scale.shape == (96, 1)  # one scale per channel
    assert torch.equal(layer.dequantize(), weight.dequantize())
    x = torch.randn(rows, 128, generator=gen)
    ref = x.double() @ weight.dequantize().double().t() + bias.double()
    tol = 1e-5 if rows > layer.max_kernel_rows else 2e-4
    assert ((layer(x).double() - ref).abs().max() / ref.abs().max()).item() < tol
    assert layer(x.view(rows, 1, 128)).shape == (rows, 1, 96)


def test_shapes_the_layout_cannot_take_keep_torchs_kernels(monkeypatch) -> None:
    assert isinstance(quant_linear_for(_weight(64, 96, 4, 0), None, "w", "cpu"), QuantLinear)  # K % 64 != 0
    assert not cpu_quant.takes(192, 96) and cpu_quant.takes(192, 192) and cpu_quant.takes(64, 32)
    monkeypatch.setenv(cpu_quant.KERNEL_ENV, "torch")
    assert isinstance(quant_linear_for(_weight(64, 128, 4, 0), None, "w", "cpu"), QuantLinear)
    assert cpu_quant.unavailable_reason() == f"{cpu_quant.KERNEL_ENV}=torch"


def test_without_a_working_compiler_torchs_kernels_serve(tmp_path) -> None:
    code = (
        "from pdserve.kernels import cpu_quant\n"
        "assert cpu_quant.library() is None\n"
        "print(cpu_quant.unavailable_reason())\n"
    )
    env = {**os.environ, "CC": "/bin/false", cpu_quant.CACHE_ENV: str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.startswith("/bin/false failed") and not list(tmp_path.glob("*.so"))
