"""Model configuration parsed from a Hugging Face `config.json` (Llama/Mistral/Qwen2 family)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements (not bytes) of K plus V per token over all layers; multiply by itemsize."""
        return 2 * self.num_layers * self.kv_size


def _rope_from_hf(raw: dict[str, Any]) -> RopeConfig:
    # transformers v5 writes `rope_parameters` (theta inside); v4 writes `rope_theta` + `rope_scaling`.
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope type {rope_type!r}")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def model_config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    architecture = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {SUPPORTED_ARCHITECTURES}")
    model_type = raw.get("model_type", "llama")
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {hidden_act!r}")
    num_heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    is_qwen2 = model_type == "qwen2"
    attention_bias = bool(raw.get("attention_bias", False))
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", not is_qwen2) else None
    return ModelConfig(
        architecture=architecture,
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        sliding_window=int(sliding) if sliding else None,
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    with open(Path(model_dir) / "config.json") as f:
        return model_config_from_hf(json.load(f))
