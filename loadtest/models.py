"""Random-weight Llama checkpoints of a chosen size, with the tiny model's byte-level tokenizer.

A load test needs compute that looks like a real model's (a long prefill taking ~0.5 s), not real
weights: outputs are forced to exact lengths with `ignore_eos` and `min_tokens`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pdserve.models.resolve import resolve_model_path
from pdserve.models.tiny import TINY_CONFIG, default_cache_dir, write_tiny_checkpoint


def llama_config(**overrides: Any) -> dict[str, Any]:
    unknown = set(overrides) - set(TINY_CONFIG)
    if unknown:
        raise ValueError(f"unknown Llama config keys: {sorted(unknown)}")
    config = {**TINY_CONFIG, **overrides}
    if "head_dim" not in overrides:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config


def config_name(config: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:10]
    return (f"random-llama-h{config['hidden_size']}-l{config['num_hidden_layers']}"
            f"-i{config['intermediate_size']}-{digest}")


def ensure_random_llama(overrides: dict[str, Any], cache_dir: str | Path | None = None) -> Path:
    """The checkpoint directory for TINY_CONFIG + overrides; written once, published by an atomic rename."""
    config = llama_config(**overrides)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / config_name(config)
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        write_tiny_checkpoint(staging, config)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(spec: str | dict[str, Any], cache_dir: str | Path | None = None) -> str:
    """A scenario's `model`: "tiny", a checkpoint path, or {random_llama: {config.json overrides}}."""
    if isinstance(spec, dict):
        if set(spec) != {"random_llama"}:
            raise ValueError("a model mapping must be {random_llama: {config overrides}}")
        return str(ensure_random_llama(dict(spec["random_llama"] or {}), cache_dir))
    return spec if spec == "tiny" else str(resolve_model_path(spec))
