"""The embedded default model "tiny": a 4-layer Llama with random weights and a byte-level tokenizer.

Written on first use as a Hugging Face directory, so every loader path (config, safetensors,
tokenizer, chat template) is the same one a real model takes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

TINY_NAME = "tiny"
TINY_VERSION = "tiny-v1"
SPECIAL_TOKENS = ("<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>")
BOS_TOKEN, EOS_TOKEN, END_TOKEN = "<s>", "</s>", "<|end|>"
# Byte tokens take ids 0..255 (id == byte value); special tokens follow in SPECIAL_TOKENS order.
BOS_TOKEN_ID, EOS_TOKEN_ID, END_TOKEN_ID = 256, 257, 261

TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 384,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_TOKEN_ID,
    "eos_token_id": EOS_TOKEN_ID,
    "torch_dtype": "float32",
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def default_cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")


def resolve_model_path(name_or_path: str, cache_dir: str | Path | None = None) -> Path:
    """Kept for callers of the old location; see `pdserve.models.resolve.resolve_model_path`."""
    from pdserve.models.resolve import resolve_model_path as resolve

    return resolve(name_or_path, cache_dir)


def ensure_tiny_checkpoint(cache_dir: str | Path | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / TINY_VERSION
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{TINY_VERSION}-", dir=root))
    try:
        write_tiny_checkpoint(staging)
        # Rename of a directory is atomic: readers see no directory or a complete one.
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():
            raise
        # Another process published first; its copy is byte-identical.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_tiny_checkpoint(path: Path, config: dict[str, Any] | None = None) -> None:
    """`config`: a full config.json for a larger random Llama with the same tokenizer (default TINY_CONFIG)."""
    config = config or TINY_CONFIG
    _write_json(path / "config.json", config)
    from safetensors.torch import save_file  # torch only when the checkpoint must be written

    save_file(tiny_state_dict(config), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "tokenizer.json").write_text(build_tiny_tokenizer().to_str(pretty=True), encoding="utf-8")
    _write_json(
        path / "tokenizer_config.json",
        {
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "add_bos_token": True,
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": config["max_position_embeddings"],
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
    )
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": [EOS_TOKEN_ID, END_TOKEN_ID]},
    )


def tiny_state_dict(config: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = config or TINY_CONFIG
    hidden, inter, head_dim = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_dim = cfg["num_attention_heads"] * head_dim
    kv_dim = cfg["num_key_value_heads"] * head_dim
    import torch

    gen = torch.Generator().manual_seed(0)

    def normal(shape: tuple[int, int], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return normal((out_features, in_features), in_features**-0.5)

    state = {"model.embed_tokens.weight": normal((cfg["vocab_size"], hidden), 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        state[f"{p}.self_attn.q_proj.weight"] = linear(q_dim, hidden)
        state[f"{p}.self_attn.k_proj.weight"] = linear(kv_dim, hidden)
        state[f"{p}.self_attn.v_proj.weight"] = linear(kv_dim, hidden)
        state[f"{p}.self_attn.o_proj.weight"] = linear(hidden, q_dim)
        state[f"{p}.mlp.gate_proj.weight"] = linear(inter, hidden)
        state[f"{p}.mlp.up_proj.weight"] = linear(inter, hidden)
        state[f"{p}.mlp.down_proj.weight"] = linear(hidden, inter)
        state[f"{p}.input_layernorm.weight"] = torch.ones(hidden)
        state[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden)
    state["model.norm.weight"] = torch.ones(hidden)
    # Final hidden states have RMS ~1, so logits have std ~2: greedy picks are well separated.
    state["lm_head.weight"] = normal((cfg["vocab_size"], hidden), 2.0 * hidden**-0.5)
    return state


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-char table: printable Latin-1 bytes map to themselves, the rest to U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    shifted = 256
    for b in range(256):
        if b not in chars:
            chars[b] = chr(shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


def build_tiny_tokenizer() -> tokenizers.Tokenizer:
    vocab = {char: byte for byte, char in enumerate(byte_alphabet())}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
