"""Tiny random HF checkpoints (Llama with GQA + llama3 rope scaling; Qwen2 with qkv bias + tied embeddings)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdserve.models.tiny import ensure_tiny_checkpoint  # noqa: E402

VOCAB = 384


def _init_peaky(model: torch.nn.Module, seed: int) -> None:
    # Larger-than-default weights give well-separated logits, so greedy ties cannot flip on rounding.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:
                fan_in = param.shape[-1] if "embed" not in name else 1
                gain = 4.0 if "lm_head" in name else 1.0
                param.copy_(gain * torch.randn(param.shape, generator=gen) / fan_in**0.5)


def _save(model, path: Path, tokenizer_dir: Path) -> Path:
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    tiny_dir = ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny-cache"))
    root = tmp_path_factory.mktemp("hf")
    llama_config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    qwen_config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=224, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
    )
    checkpoints = {}
    for seed, (name, config, cls) in enumerate([
        ("llama", llama_config, transformers.LlamaForCausalLM),
        ("qwen2", qwen_config, transformers.Qwen2ForCausalLM),
    ]):
        torch.manual_seed(seed)
        model = cls(config).eval()
        _init_peaky(model, seed)
        checkpoints[name] = (_save(model, root / name, tiny_dir), model)
    return checkpoints
