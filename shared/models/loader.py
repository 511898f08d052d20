"""Load a Hugging Face checkpoint directory: config.json and (sharded) *.safetensors."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.models.config import ModelConfig, load_model_config
from pdserve.models.gguf import QUANTIZED_FILE
from pdserve.models.linear import pack_linears
from pdserve.models.llama import MODEL_REGISTRY
from pdserve.models.quant_load import apply_blocks, apply_float, plan_quantization
from pdserve.runtime.heap import trim_heap

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.name != QUANTIZED_FILE)
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def iter_weights(model_dir: Path, skip: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name not in skip:
                    yield name, f.get_tensor(name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: str | Path, dtype: torch.dtype, device: str, max_positions: int | None = None,
    pack_weights: bool = False, quantization: str = "none",
) -> tuple[torch.nn.Module, ModelConfig]:
    """pack_weights: on CPU, reorder linear weights for oneDNN (pdserve.models.linear).
    quantization: "none" | "auto" | "int8" | "int4" | "fp8" weight-only linears (pdserve.models.quant_load:
    QuantLinear on CPU, CudaQuantLinear on CUDA); a quantized linear keeps only its quantized copy, and
    is never packed."""
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    model_cls = MODEL_REGISTRY[config.architecture]
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(config, max_positions=max_positions)
    plan = plan_quantization(model, config, model_dir, quantization)
    apply_blocks(model, model_dir, plan, dtype)
    skipped = plan.skipped_float_weights
    filled = model.load_weights((n, t) for n, t in iter_weights(model_dir, skipped))
    missing = model.expected_weights() - filled
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights: {sorted(missing)[:8]}")
    apply_float(model, plan)
    if quantization != "none":
        logger.info("%s", plan.describe())
        trim_heap()  # a quantized load's transients (SmolLM2, auto: RSS 964 -> 481 MiB)
    model = model.eval().requires_grad_(False)
    if pack_weights:
        pack_linears(model)
    return model, config
