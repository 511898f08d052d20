"""What a loaded model serves: its weights' format per linear (for the start-up line) and the bytes one
decode step at batch 1 reads (for the roofline)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

from pdserve.kernels import cpu_quant
from pdserve.models.config import ModelConfig
from pdserve.models.linear import Linear
from pdserve.models.quant_linear import QuantEmbedding, QuantLinear
from pdserve.models.quant_linear_native import NativeQuantLinear, TiedQuantEmbedding
from pdserve.models.quant_load import linear_sources, read_block_types

# buffers a QuantLinear's kernel path reads at up to `max_kernel_rows` rows; its float32 `scale` and
# `offset` serve the dequantizing path of longer batches only (NativeQuantLinear's kernel reads all three)
KERNEL_BUFFERS = ("packed", "kernel_scales")
NATIVE_BUFFERS = ("packed", "scale", "offset")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def decode_read_bytes(model: nn.Module) -> int:
    """Weight bytes one decode step at batch 1 streams: a quantized linear's codes and kernel scales, a
    float linear's plain weight (its oneDNN copy serves 2+ rows only), norms and biases; not the embedding
    table, of which the step reads one row."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear | NativeQuantLinear):
            names = NATIVE_BUFFERS if isinstance(module, NativeQuantLinear) else KERNEL_BUFFERS
            total += sum(_nbytes(getattr(module, name)) for name in names) + _nbytes(module.bias)
        elif isinstance(module, nn.Embedding | QuantEmbedding):
            continue
        else:
            total += sum(_nbytes(p) for p in module.parameters(recurse=False))
    return total


def _source_types(name: str, config: ModelConfig, block_types: dict[str, str]) -> str:
    types = {block_types.get(source, "float") for source in linear_sources(name, config)}
    return "/".join(sorted(types))


def describe_weights(model: nn.Module, config: ModelConfig, model_dir: Path, quantization: str) -> str:
    """`quantization auto: 120 linears int4 (GGUF Q4_1), 1 linears int8 (GGUF Q8_0); embedding from GGUF
    blocks (Q8_0)`: what the loaded modules are, not what was asked."""
    block_types = read_block_types(model_dir) if quantization != "none" else {}
    counts: dict[str, int] = {}
    embedding = "embedding float"
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear | NativeQuantLinear):
            types = _source_types(name, config, block_types)
            source = f"GGUF {types}" if "float" not in types else "rounded to nearest"
            key = f"int{module.bits} ({source}, kernel {module.kernel})"
        elif isinstance(module, Linear):
            key = f"{str(module.weight.dtype).removeprefix('torch.')}"
        elif isinstance(module, QuantEmbedding):
            tied = ", read from the LM head's codes" if isinstance(module, TiedQuantEmbedding) else ""
            embedding = f"embedding from GGUF blocks ({block_types.get('model.embed_tokens.weight', '?')}{tied})"
            continue
        else:
            continue
        counts[key] = counts.get(key, 0) + 1
    linears = ", ".join(f"{n} linears {key}" for key, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    if any(isinstance(m, QuantLinear) for m in model.modules()) and (why := cpu_quant.unavailable_reason()):
        linears += f" (native kernel unavailable: {why})"
    return f"quantization {quantization}: {linears}; {embedding}"


def served_line(model: nn.Module, config: ModelConfig, model_dir: Path, quantization: str, dtype: str,
                asked_dtype: str | None, device: str) -> str:
    """The start-up line: weights as served, the bytes a batch-1 decode step reads, the activation dtype
    and the hardware that decided it."""
    why = f"dtype {asked_dtype or 'default'}"
    if not device.startswith("cuda"):
        from pdserve.cpu_caps import cpu_caps

        why += f"; {cpu_caps().describe()}"
    return (f"{describe_weights(model, config, model_dir, quantization)}; decode step reads "
            f"{decode_read_bytes(model) / 1e6:.1f} MB of weights; activations {dtype} ({why})")


def check_quantization(model: str, quantization: str) -> None:
    """Refuses (ValueError naming the tensor and the reason) a quantization the model cannot be served in,
    from its config and the file's block types alone: the model is built on the meta device, no weights read."""
    from pdserve.models.config import load_model_config
    from pdserve.models.llama import MODEL_REGISTRY
    from pdserve.models.quant_load import plan_quantization
    from pdserve.models.resolve import resolve_model_path

    model_dir = resolve_model_path(model)
    config = load_model_config(model_dir)
    with torch.device("meta"):
        module = MODEL_REGISTRY[config.architecture](config)
    plan_quantization(module, config, model_dir, quantization)


def main(argv: list[str]) -> int:
    """`python -m pdserve.models.served MODEL QUANTIZATION [MODEL QUANTIZATION ...]`: check_quantization of
    each pair in this process (so that the caller need not import torch); the first refusal on stderr as
    `INDEX WHAT reason` (INDEX: the pair's, from 0; WHAT: `model` when the model is not found, else
    `quantization`), exit code 2."""
    for index, (model, quantization) in enumerate(zip(argv[::2], argv[1::2])):
        try:
            check_quantization(model, quantization)
        except (ValueError, FileNotFoundError) as exc:
            print(f"{index} {'model' if isinstance(exc, FileNotFoundError) else 'quantization'} {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
