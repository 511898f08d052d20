import pytest
import torch

from pdserve.kernels.fp8_matmul import (
    device_has_fp8,
    fp8_matmul,
    fp8_matmul_ref,
    fp8_refusal,
    quantize_fp8_rows,
)
from pdserve.kernels.quant_matmul import (
    GEMV_ROWS,
    choose_config,
    dequantize_ref,
    gemv_config,
    gemv_sub_tile,
    pack_int4,
    quant_matmul,
    quant_matmul_ref,
    unpack_int4,
)
from pdserve.models.quant_linear_cuda import CudaQuantLinear, quant_linear_for
from pdserve.models.quantization import from_gguf_blocks, quantize_rtn, quantize_rtn_symmetric

REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # of max |reference|


def assert_matches(y: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype and y.shape == expected.shape
    err = (y.float() - expected.float()).abs().max().item()
    assert err <= REL_TOL[dtype] * expected.float().abs().max().item() + 1e-6, err


def _operands(bits: int, n: int, k: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen)
    q = quantize_rtn(weight, bits, group, "w")
    packed = pack_int4(q.codes) if bits == 4 else q.codes
    return q, packed


def test_pack_int4_layout_and_round_trip():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_int4(codes).tolist() == [[0x21, 0x0F]]  # low nibble: even k
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 3, 16, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_matmul_matches_reference(bits, m, dtype):
    n, k, group = 80, 224, 32  # K: 7 groups, not a multiple of any BLOCK_K; N: not of BLOCK_N
    q, packed = _operands(bits, n, k, group, seed=bits * 100 + m)
    assert torch.equal(dequantize_ref(packed, q.scale, q.offset, bits, group), q.dequantize())
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    expected = x.float() @ q.dequantize().t()
    assert_matches(quant_matmul(x, packed, q.scale, q.offset, bits, group), expected, dtype)
    assert_matches(quant_matmul_ref(x, packed, q.scale, q.offset, bits, group), expected, dtype)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_path_matches_reference(bits, m, dtype):
    n, k, group = 37, 1056, 32  # N odd; K: 33 groups, not a multiple of BLOCK_K (512 int4, 256 int8)
    q, packed = _operands(bits, n, k, group, seed=bits + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    expected = quant_matmul_ref(x, packed, q.scale, q.offset, bits, group)
    for splits in (None, 1, 2, 3):
        y = quant_matmul(x, packed, q.scale, q.offset, bits, group, splits=splits, path="gemv")
        assert_matches(y, expected, dtype)
    assert_matches(quant_matmul(x, packed, q.scale, q.offset, bits, group, path="dot"), expected, dtype)


@pytest.mark.parametrize("bits", [4, 8])
def test_gemv_path_group_layouts_and_many_rows(bits):
    # group 128 (two per int8 tile), group 1024 (multiple of the tile), group 48 (per-element scales);
    # 11 rows: two row blocks of 8
    gen = torch.Generator().manual_seed(bits)
    for k, group in ((640, 128), (2048, 1024), (480, 48)):
        q = quantize_rtn(torch.randn(19, k, generator=gen), bits, group, "w")
        packed = pack_int4(q.codes) if bits == 4 else q.codes
        x = torch.randn(11, k, generator=gen)
        y = quant_matmul(x, packed, q.scale.half(), q.offset.half(), bits, group, path="gemv")
        assert_matches(y, x @ dequantize_ref(packed, q.scale.half(), q.offset.half(), bits, group).t(),
                       torch.float32)
    assert gemv_sub_tile(bits, 48, 256 * (2 if bits == 4 else 1)) == 0


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_split_k_and_strided_input_and_half_scales(bits, splits):
    n, k, group = 48, 544, 32  # 5 BLOCK_K iterations at decode
    q, packed = _operands(bits, n, k, group, seed=splits)
    scale, offset = q.scale.half(), q.offset.half()
    wide = torch.randn(2, 3, k + 40)
    x = wide[..., 8 : 8 + k]  # [2, 3, K], rows strided
    expected = x @ dequantize_ref(packed, scale, offset, bits, group).t()
    y = quant_matmul(x, packed, scale, offset, bits, group, splits=splits)
    assert y.shape == (2, 3, n)
    assert_matches(y, expected, torch.float32)


def test_int8_per_channel_and_gguf_blocks():
    gen = torch.Generator().manual_seed(3)
    for k in (96, 256):  # group = K: per-element scales (96), one scale per tile (256)
        q = quantize_rtn_symmetric(torch.randn(40, k, generator=gen), "w")
        x = torch.randn(5, k, generator=gen)
        for m in (1, 5):
            y = quant_matmul(x[:m], q.codes, q.scale, q.offset, 8, q.group_size)
            assert_matches(y, x[:m] @ q.dequantize().t(), torch.float32)
    # Q4_0: d (float16) then 16 bytes: element j low nibble, j + 16 high
    raw = torch.randint(0, 256, (16, 4, 18), dtype=torch.uint8, generator=gen)
    raw[:, :, :2] = torch.rand(16, 4, 1, generator=gen).half().view(torch.uint8).view(16, 4, 2)
    q4 = from_gguf_blocks(raw.view(16, -1).numpy(), "Q4_0", "w")
    x = torch.randn(2, 128, generator=gen)
    y = quant_matmul(x, pack_int4(q4.codes), q4.scale, q4.offset, 4, 32)
    assert_matches(y, x @ q4.dequantize().t(), torch.float32)


def test_choose_config_splits_decode_only():
    rows, block_n, _, splits = gemv_config(1, 4096, 4096, 4, num_sms=132)
    assert rows == 1 and 4096 // block_n * splits >= 2 * 132
    assert gemv_config(5, 28672, 4096, 8, num_sms=132)[::3] == (GEMV_ROWS, 1)  # N alone fills the GPU
    assert choose_config(1, 4096, 4096, num_sms=132)[3] > 1
    assert choose_config(1, 4096, 256, num_sms=132)[3] == 1  # too few K iterations to split
    assert choose_config(512, 4096, 4096)[3] == 1
    with pytest.raises(ValueError, match="do not agree"):
        quant_matmul(torch.randn(1, 64), torch.zeros(8, 16, dtype=torch.uint8), torch.ones(8, 1),
                     torch.zeros(8, 1), 4, 32)
    with pytest.raises(ValueError, match="path"):
        quant_matmul(torch.randn(1, 64), torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 2),
                     torch.zeros(8, 2), 4, 32, path="gemm")


@pytest.mark.parametrize("bits", [4, 8])
def test_cuda_quant_linear_forward_through_the_kernel(bits):
    gen = torch.Generator().manual_seed(bits)
    q = quantize_rtn(torch.randn(64, 96, generator=gen), bits, 32, "w")
    bias = torch.randn(64, generator=gen)
    layer = CudaQuantLinear.from_quantized(q, bias, "cpu")  # the interpreter runs the kernel on CPU
    assert layer.scale.dtype in (torch.float16, torch.float32) and layer.nbytes() > 0
    assert torch.equal(layer.dequantize(), dequantize_ref(layer.packed, layer.scale, layer.offset, bits, 32))
    x = torch.randn(2, 3, 96, generator=gen)
    assert_matches(layer(x), x @ layer.dequantize().t() + bias, torch.float32)
    assert not isinstance(quant_linear_for(q, bias, "w", "cpu"), CudaQuantLinear)  # CPU kernels on CPU


def test_fp8_reference_and_refusal_on_cpu():
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(32, 64, generator=gen), torch.randn(3, 64, generator=gen)
    w8, scale = quantize_fp8_rows(w)
    assert w8.dtype == torch.float8_e4m3fn and scale.shape == (32,)
    assert (w8.float() * scale[:, None] - w).abs().max() <= w.abs().max() / 8  # 3 mantissa bits
    y = fp8_matmul_ref(x, w8, scale)
    assert (y - x @ w.t()).abs().max() <= 0.1 * (x @ w.t()).abs().max()
    assert not device_has_fp8("cpu") and "cpu" in fp8_refusal("cpu")
    with pytest.raises(RuntimeError, match="FP8"):
        fp8_matmul(x, w8, scale)
    with pytest.raises(ValueError, match="fp8"):
        CudaQuantLinear.from_float_fp8(w, None, "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_quant_bench_refuses_without_cuda(capsys):
    from pdserve.bench import quant_kernels

    with pytest.raises(RuntimeError, match="CUDA"):
        quant_kernels.run(quick=True)
    assert quant_kernels.main(["--json"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
