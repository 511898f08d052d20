"""Load a Hugging Face checkpoint directory: config.json and (sharded) *.safetensors."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.models.config import ModelConfig, load_model_config
from pdserve.models.linear import pack_linears
from pdserve.models.llama import MODEL_REGISTRY


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    return files


def iter_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
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
    pack_weights: bool = False,
) -> tuple[torch.nn.Module, ModelConfig]:
    """pack_weights: on CPU, reorder linear weights for oneDNN (pdserve.models.linear)."""
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    model_cls = MODEL_REGISTRY[config.architecture]
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(config, max_positions=max_positions)
    filled = model.load_weights(iter_weights(model_dir))
    missing = model.expected_weights() - filled
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights: {sorted(missing)[:8]}")
    model = model.eval().requires_grad_(False)
    if pack_weights:
        pack_linears(model)
    return model, config
