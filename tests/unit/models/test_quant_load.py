"""Loading quantized: which linears each mode takes from GGUF blocks or rounds to nearest, and refusals.

The kernel names pinned here are torch's (PDSERVE_CPU_KERNELS=torch); the native kernel's choice and
accuracy are tested in tests/unit/kernels/test_cpu_quant.py and, on the served model, in
tests/correctness/test_quantized_parity.py; test_native_kernel_serves_the_same_choices runs it here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from pdserve.kernels import cpu_quant
from pdserve.models.attention import AttentionMetadata, PrefillChunk
from pdserve.models.gguf import ensure_hf_checkpoint
from pdserve.models.linear import Linear
from pdserve.models.loader import load_model
from pdserve.models.quant_linear import QuantEmbedding, QuantLinear
from pdserve.models.quant_linear_native import NativeQuantLinear, TiedQuantEmbedding
from pdserve.models.quant_load import quantized_bytes
from pdserve.models.tiny import ensure_tiny_checkpoint

PROMPT = list(range(3, 40))
QUANT_LINEARS = (QuantLinear, NativeQuantLinear)


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch) -> None:
    monkeypatch.setenv(cpu_quant.KERNEL_ENV, "torch")


@torch.no_grad()
def _logits(model: torch.nn.Module, kernel_rows: int | None = None) -> torch.Tensor:
    for module in model.modules():
        if isinstance(module, QUANT_LINEARS) and kernel_rows is not None:
            module.max_kernel_rows = kernel_rows
    c, n = model.config, len(PROMPT)
    block = torch.zeros((n + 15) // 16, 16, c.num_kv_heads, c.head_dim)
    caches = [(block.clone(), block.clone()) for _ in range(c.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        num_decode_tokens=0,
        decode_groups=(),
        prefills=(PrefillChunk(0, n, n, torch.arange(block.shape[0])),),
    )
    return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(n), caches, meta))


def _kernels(model: torch.nn.Module) -> dict[str, str]:
    return {
        n: m.kernel if isinstance(m, QUANT_LINEARS) else "float"
        for n, m in model.named_modules()
        if isinstance(m, (Linear, *QUANT_LINEARS)) and n.startswith(("layers.0.", "lm_head"))
    }


@pytest.fixture
def gguf_dir(tmp_path: Path, llama_gguf) -> Path:
    path, _ = (
        llama_gguf()
    )  # q Q4_0, k Q4_1, v F16, o BF16, gate Q8_0, up Q4_1, down F32, output Q4_0, embd Q8_0
    return ensure_hf_checkpoint(path, tmp_path / "cache")


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        (
            "auto",
            {
                "qkv_proj": "float",
                "o_proj": "float",
                "gate_up_proj": "int8_split",
                "down_proj": "float",
                "lm_head": "int4",
            },
        ),
        (
            "int4",
            {
                "qkv_proj": "int4",
                "o_proj": "int4",
                "gate_up_proj": "int4",
                "down_proj": "int4",
                "lm_head": "int4",
            },
        ),
        (
            "int8",
            {
                "qkv_proj": "int8_channel",
                "o_proj": "int8_channel",
                "gate_up_proj": "int8_split",
                "down_proj": "int8_channel",
                "lm_head": "int8_split",
            },
        ),
    ],
)
def test_gguf_modes_choose_per_tensor_and_match_the_float_model(
    gguf_dir: Path, mode: str, expected: dict
) -> None:
    reference, _ = load_model(gguf_dir, torch.float32, "cpu")
    model, _ = load_model(gguf_dir, torch.float32, "cpu", pack_weights=True, quantization=mode)
    kernels = {name.split(".")[-1]: kernel for name, kernel in _kernels(model).items()}
    assert kernels == expected
    assert isinstance(model.embed_tokens, QuantEmbedding)  # the file's Q8_0 table, read exactly
    ref = _logits(reference)
    scale = ref.abs().max()
    exact = (_logits(model, kernel_rows=0) - ref).abs().max() / scale
    kernel = (_logits(model, kernel_rows=1 << 30) - ref).abs().max() / scale
    if mode == "auto":  # only the file's blocks are quantized, so the exact path is the float model
        assert exact < 1e-5
    else:  # round-to-nearest of float tensors (int4 also re-rounds the Q8_0 gate to 4 bits)
        assert exact < (0.2 if mode == "int4" else 0.05)
    print(f"\n{mode}: exact {exact:.2e} kernel {kernel:.2e}")
    assert kernel < exact + 0.03


def test_hf_checkpoint_rounds_to_nearest_and_auto_leaves_it_float(tmp_path: Path) -> None:
    model_dir = ensure_tiny_checkpoint(tmp_path)
    reference, _ = load_model(model_dir, torch.float32, "cpu")
    auto, _ = load_model(model_dir, torch.float32, "cpu", quantization="auto")
    assert not [m for m in auto.modules() if isinstance(m, QuantLinear)]
    int8, _ = load_model(model_dir, torch.float32, "cpu", quantization="int8")
    assert set(_kernels(int8).values()) == {"int8_channel"}
    ref = _logits(reference)
    assert (_logits(int8, kernel_rows=0) - ref).abs().max() / ref.abs().max() < 0.02


def test_refused_at_load_with_tensor_and_reason(tmp_path: Path, gguf_dir: Path) -> None:
    tiny = ensure_tiny_checkpoint(tmp_path)  # intermediate_size 688: not a multiple of 32
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.down_proj\.weight': in_features 688 .* group 32"
    ):
        load_model(tiny, torch.float32, "cpu", quantization="int4")
    with pytest.raises(ValueError, match="fp8"):
        load_model(gguf_dir, torch.float32, "cpu", quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(gguf_dir, torch.float32, "cpu", quantization="int3")


@pytest.mark.skipif(cpu_quant.library() is None, reason="native kernel not built")
def test_native_kernel_serves_the_same_choices(gguf_dir: Path, monkeypatch) -> None:
    """The default kernel: every quantized linear whose K is a multiple of 64 goes native; same bits and the
    same logits as torch's exact path."""
    torch_model, _ = load_model(gguf_dir, torch.float32, "cpu", quantization="auto")
    monkeypatch.setenv(cpu_quant.KERNEL_ENV, "native")
    model, _ = load_model(gguf_dir, torch.float32, "cpu", quantization="auto")
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QUANT_LINEARS)}
    torch_quant = {n: m for n, m in torch_model.named_modules() if isinstance(m, QUANT_LINEARS)}
    assert quant.keys() == torch_quant.keys() and quant
    for name, module in quant.items():
        assert module.bits == torch_quant[name].bits
        native = module.in_features % 64 == 0
        assert isinstance(module, NativeQuantLinear if native else QuantLinear), name
    ref = _logits(torch_model, kernel_rows=0)
    scale = ref.abs().max()
    assert (_logits(model, kernel_rows=0) - ref).abs().max() / scale < 1e-5
    assert (_logits(model, kernel_rows=1 << 30) - ref).abs().max() / scale < 1e-3


@pytest.mark.skipif(cpu_quant.library() is None, reason="native kernel not built")
def test_tied_q8_table_is_held_once_and_reads_as_the_file(tmp_path: Path, llama_gguf, monkeypatch) -> None:
    """A tied Q8_0 table served native: the embedding reads the LM head's packed codes and scales (no second
    copy), and every row dequantizes exactly as the file's own table does."""
    path, _ = llama_gguf(tied=True)
    model_dir = ensure_hf_checkpoint(path, tmp_path / "cache")
    separate, config = load_model(model_dir, torch.float32, "cpu", quantization="auto")  # torch kernels
    assert type(separate.embed_tokens) is QuantEmbedding
    monkeypatch.setenv(cpu_quant.KERNEL_ENV, "native")
    model, _ = load_model(model_dir, torch.float32, "cpu", quantization="auto")
    head, table = model.lm_head, model.embed_tokens
    assert isinstance(head, NativeQuantLinear) and head.bits == 8
    assert isinstance(table, TiedQuantEmbedding) and table.packed.data_ptr() == head.packed.data_ptr()
    ids = torch.arange(config.vocab_size)
    assert torch.equal(table(ids), separate.embed_tokens(ids))
    grid = ids[:256].view(8, 32)
    assert torch.equal(table(grid), separate.embed_tokens(grid)) and table(grid).shape == (8, 32, config.hidden_size)
    assert quantized_bytes(model)["quantized_bytes"] == sum(
        m.nbytes() for m in model.modules() if isinstance(m, NativeQuantLinear | QuantLinear))
    assert _logits(model, kernel_rows=0).equal(_logits(_with(model, separate.embed_tokens), kernel_rows=0))


def _with(model: torch.nn.Module, embedding: torch.nn.Module) -> torch.nn.Module:
    model.embed_tokens = embedding
    return model
