"""The quantized-linear kernels of tests/unit/kernels/test_quant_matmul.py, compiled on CUDA at
Llama-3-8B shapes. Run in a pytest session of its own (`pytest -m gpu tests/gpu`): kernel modules are
imported inside the tests, as in test_kernels_cuda.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REL_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # of max |reference|
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336)]  # (N, K)


@pytest.fixture(scope="module")
def qm():
    import triton

    if triton.knobs.runtime.interpret:
        pytest.skip("TRITON_INTERPRET is on in this session: run tests/gpu in a pytest session of its own")
    from pdserve.kernels import quant_matmul

    return quant_matmul


def assert_matches(y: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == expected.shape
    assert torch.isfinite(y).all()
    err = (y.float() - expected.float()).abs().max().item()
    assert err <= REL_TOL[dtype] * expected.float().abs().max().item(), err


def _operands(qm, bits: int, n: int, k: int, seed: int, scale_dtype=torch.float16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
    packed = qm.pack_int4(codes) if bits == 4 else codes
    scale = (torch.rand(n, k // 32, device="cuda", generator=gen) / 2**bits).to(scale_dtype)
    offset = (-(2 ** (bits - 1)) * scale.float() + 0.01 * torch.randn(scale.shape, device="cuda",
                                                                     generator=gen)).to(scale_dtype)
    return packed, scale, offset, gen


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 16, 512])
def test_quant_matmul_real_shapes(qm, bits, dtype, n, k, m):
    packed, scale, offset, gen = _operands(qm, bits, n, k, seed=bits + m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    expected = x.float() @ qm.dequantize_ref(packed, scale, offset, bits, 32).t()
    assert_matches(qm.quant_matmul(x, packed, scale, offset, bits, 32), expected, dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", [(4096, 4096), (14336, 4096)])
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_and_dot_paths_agree_at_real_shapes(qm, bits, n, k, m):
    packed, scale, offset, gen = _operands(qm, bits, n, k, seed=bits + m)
    scale, offset = qm.n_major(scale), qm.n_major(offset)  # as CudaQuantLinear holds them
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    expected = x.float() @ qm.dequantize_ref(packed, scale, offset, bits, 32).t()
    for path in ("gemv", "dot"):
        for splits in (None, 1, 5):
            y = qm.quant_matmul(x, packed, scale, offset, bits, 32, splits=splits, path=path)
            assert_matches(y, expected, torch.bfloat16)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [3, 70, 1500])
def test_quant_matmul_odd_rows_fp32_scales_and_splits(qm, bits, m):
    n, k = 1000, 4128  # N not a multiple of BLOCK_N, K not of BLOCK_K
    packed, scale, offset, gen = _operands(qm, bits, n, k, seed=m, scale_dtype=torch.float32)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    expected = x.float() @ qm.dequantize_ref(packed, scale, offset, bits, 32).t()
    for splits in (None, 1, 7):
        assert_matches(qm.quant_matmul(x, packed, scale, offset, bits, 32, splits=splits), expected,
                       torch.bfloat16)
    if m <= 70:
        assert_matches(qm.quant_matmul(x, packed, scale, offset, bits, 32, path="gemv"), expected,
                       torch.bfloat16)
    x32 = x.float()
    assert_matches(qm.quant_matmul(x32, packed, scale, offset, bits, 32), expected, torch.float32)


@pytest.mark.parametrize("m", [1, 16, 512])
def test_fp8_matmul(m):
    from pdserve.kernels.fp8_matmul import device_has_fp8, fp8_matmul, fp8_matmul_ref, quantize_fp8_rows

    if not device_has_fp8("cuda"):
        pytest.skip("no FP8 tensor cores on this GPU")
    gen = torch.Generator(device="cuda").manual_seed(m)
    w8, scale = quantize_fp8_rows(torch.randn(4096, 4096, device="cuda", generator=gen))
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(m, 4096, device="cuda", generator=gen).to(dtype)
        expected = fp8_matmul_ref(x.float(), w8, scale)
        assert_matches(fp8_matmul(x, w8, scale), expected, dtype)


def test_cuda_quant_linears_in_a_small_model(qm):
    from pdserve.kernels.fp8_matmul import device_has_fp8
    from pdserve.models.quant_linear_cuda import CudaQuantLinear
    from pdserve.models.quantization import quantize_rtn, quantize_rtn_symmetric

    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(2048, 1024, generator=gen) / 32, torch.randn(1024, 2048, generator=gen) / 45
    layers = {
        "int4": [CudaQuantLinear.from_quantized(quantize_rtn(w, 4, 32, "w"), None, "cuda") for w in (w1, w2)],
        "int8": [CudaQuantLinear.from_quantized(quantize_rtn_symmetric(w, "w"), None, "cuda") for w in (w1, w2)],
    }
    if device_has_fp8("cuda"):
        layers["fp8"] = [CudaQuantLinear.from_float_fp8(w, None, "cuda") for w in (w1, w2)]
    x = torch.randn(4, 7, 1024, generator=gen).cuda().to(torch.bfloat16)
    for kind, (up, down) in layers.items():
        y = down(torch.nn.functional.silu(up(x)))
        expected = torch.nn.functional.silu(x.float() @ up.dequantize().t()) @ down.dequantize().t()
        err = (y.float() - expected).abs().max().item() / expected.abs().max().item()
        assert y.shape == (4, 7, 1024) and y.dtype == torch.bfloat16
        assert err < (0.1 if kind == "fp8" else 3e-2), (kind, err)
