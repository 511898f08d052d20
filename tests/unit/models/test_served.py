"""What a loaded model serves: the start-up description of its weights, the bytes a batch-1 decode step
reads, and the refusal of a quantization the model cannot take, before any weight is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from pdserve.kernels import cpu_quant
from pdserve.models.gguf import ensure_hf_checkpoint
from pdserve.models.linear import Linear
from pdserve.models.loader import load_model
from pdserve.models.quant_linear import QuantLinear, torch_int4_layout
from pdserve.models.quant_linear_native import NativeQuantLinear
from pdserve.models.served import check_quantization, decode_read_bytes, describe_weights
from pdserve.models.tiny import ensure_tiny_checkpoint


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_float_model_reads_every_parameter_but_the_embedding(tmp_path: Path) -> None:
    model, config = load_model(ensure_tiny_checkpoint(tmp_path), torch.float32, "cpu", pack_weights=True)
    everything = sum(_nbytes(p) for p in model.parameters())
    assert decode_read_bytes(model) == everything - config.vocab_size * config.hidden_size * 4  # packed copy not read
    line = describe_weights(model, config, ensure_tiny_checkpoint(tmp_path), "none")
    assert line == "quantization none: 17 linears float32; embedding float"


def test_int8_reads_its_codes_and_kernel_scales_not_its_exact_scales(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(cpu_quant.KERNEL_ENV, "torch")  # torch's kernels: bfloat16 scales beside exact ones
    model, config = load_model(ensure_tiny_checkpoint(tmp_path), torch.float32, "cpu", quantization="int8")
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 17 and not any(isinstance(m, Linear) for m in model.modules())
    # per-channel int8 from float weights: 1 byte per weight + one bfloat16 scale per output row
    codes = sum(m.in_features * m.out_features + 2 * m.out_features for m in quant)
    norms = sum(_nbytes(p) for n, p in model.named_parameters() if "norm" in n)
    assert decode_read_bytes(model) == codes + norms
    exact = sum(_nbytes(m.scale) + _nbytes(m.offset) for m in quant)  # held for prefill, not read at 1 row
    assert exact > 0 and decode_read_bytes(model) + exact <= sum(m.nbytes() for m in quant) + norms
    assert describe_weights(model, config, ensure_tiny_checkpoint(tmp_path), "int8") == (
        "quantization int8: 17 linears int8 (rounded to nearest, kernel int8_channel) (native kernel "
        "unavailable: PDSERVE_CPU_KERNELS=torch); embedding float")


def test_gguf_auto_names_each_linears_blocks(tmp_path: Path, llama_gguf, monkeypatch) -> None:
    monkeypatch.setenv(cpu_quant.KERNEL_ENV, "torch")
    path, _ = llama_gguf()  # q Q4_0, k Q4_1, v F16, o BF16, gate Q8_0, up Q4_1, down F32, output Q4_0, embd Q8_0
    model_dir = ensure_hf_checkpoint(path, tmp_path / "cache")
    model, config = load_model(model_dir, torch.float32, "cpu", quantization="auto")
    line = describe_weights(model, config, model_dir, "auto")
    assert line.startswith("quantization auto: ")
    assert "2 linears int8 (GGUF Q4_1/Q8_0, kernel int8_split)" in line  # gate_up of each layer: 4 and 8 bits at 8
    assert "1 linears int4 (GGUF Q4_0, kernel int4)" in line  # the LM head
    assert line.endswith("embedding from GGUF blocks (Q8_0)")
    head = model.lm_head
    # int4 at 1 row: half a byte per weight (rows padded to torch's blocks) and a bfloat16 scale and zero per group
    # of 32
    block = torch_int4_layout().block_rows
    rows = -(-head.out_features // block) * block
    assert _nbytes(head.packed) + _nbytes(head.kernel_scales) == rows * head.in_features // 2 + rows * (
        head.in_features // 32) * 4


@pytest.mark.skipif(cpu_quant.library() is None, reason="native kernel not built")
def test_native_int8_reads_its_codes_and_block_scales(tmp_path: Path) -> None:
    model, config = load_model(ensure_tiny_checkpoint(tmp_path), torch.float32, "cpu", quantization="int8")
    native = [m for m in model.modules() if isinstance(m, NativeQuantLinear)]
    torch_kernel = [m for m in model.modules() if isinstance(m, QuantLinear)]  # K not a multiple of 64
    assert native and len(native) + len(torch_kernel) == 17
    # 1 byte per weight + a float32 scale and offset per output row, all read by the kernel
    codes = sum(m.in_features * m.out_features + 8 * m.out_features for m in native)
    codes += sum(m.in_features * m.out_features + 2 * m.out_features for m in torch_kernel)
    norms = sum(_nbytes(p) for n, p in model.named_parameters() if "norm" in n)
    assert decode_read_bytes(model) == codes + norms
    isa = cpu_quant.isa(cpu_quant.library())
    line = describe_weights(model, config, ensure_tiny_checkpoint(tmp_path), "int8")
    assert f"linears int8 (rounded to nearest, kernel native-{isa})" in line


@pytest.mark.parametrize(("quantization", "reason"), [
    ("int4", "tensor 'model.layers.0.mlp.down_proj.weight': in_features 688 is not a multiple of the quantization group 32"),
    ("fp8", "FP8 weights need a GPU with FP8"),
])
def test_a_quantization_the_model_cannot_take_is_refused_before_loading(quantization: str, reason: str) -> None:
    check_quantization("tiny", "int8")
    with pytest.raises(ValueError, match=reason.replace("(", r"\(")):
        check_quantization("tiny", quantization)
