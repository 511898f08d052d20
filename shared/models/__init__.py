"""Model family (Llama/Mistral/Qwen2), HF checkpoint and GGUF loading, tokenizer, the embedded `tiny` model.

Names load lazily, so `pdserve.models.tokenizer` (used by the router) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ModelConfig": "config", "load_model_config": "config", "MODEL_REGISTRY": "llama",
    "LlamaForCausalLM": "llama", "load_model": "loader",
    "resolve_model_path": "resolve", "served_model_name": "resolve", "MODEL_ALIASES": "resolve",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_LAZY)
