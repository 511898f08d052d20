"""GGUF files as Hugging Face checkpoint directories, converted once into the cache.

A `.gguf` (llama.cpp's format: metadata + possibly quantized tensors) is dequantized to float32,
renamed to HF Llama names and written with its tokenizer as config.json, model.safetensors,
tokenizer.json, tokenizer_config.json and generation_config.json. From there the ordinary loader
takes it like any checkpoint. The Q4_0 / Q4_1 / Q8_0 tensors are also kept as stored, their blocks in
QUANTIZED_FILE (rows in HF order), for the weight-only quantized linears (pdserve.models.quantization).
No torch here: the router converts too.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from pdserve.models.gguf_tokenizer import build_tokenizer, generation_config, tokenizer_config

CONVERTER_VERSION = "gguf-v2"
QUANTIZED_FILE = "quantized.safetensors"  # HF name -> [rows, row bytes] uint8 blocks; metadata: name -> type
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
_HASH_SPAN = 16 << 20  # bytes hashed at each end of the file for its identity

# GGUF tensor name after "blk.N." -> HF name after "model.layers.N."
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_identity(path: str | Path) -> str:
    """Cache key of a GGUF file: converter version, size and a hash of its first and last 16 MiB."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"{CONVERTER_VERSION}:{size}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(_HASH_SPAN))
        if size > _HASH_SPAN:
            f.seek(max(_HASH_SPAN, size - _HASH_SPAN))
            digest.update(f.read())
    return digest.hexdigest()[:20]


def ensure_hf_checkpoint(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """The converted directory of `gguf_path`, converting it on first use.

    Processes converting the same file at once serialize on a lock file; the directory is written
    under a temporary name and published by an atomic rename, so readers see nothing or all of it.
    """
    from pdserve.models.tiny import default_cache_dir

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    root = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "gguf"
    target = root / f"{gguf_path.stem}-{gguf_identity(gguf_path)}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_dir():  # converted by another process while this one waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
        try:
            convert_gguf(gguf_path, staging)
            for path in (staging, *staging.iterdir()):  # mkdtemp makes 0700; the cache may be shared
                path.chmod(0o755 if path.is_dir() else 0o644)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> None:
    import gguf
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    names = [t.name for t in reader.tensors]
    config = hf_config(meta, names)
    weights: dict[str, np.ndarray] = {}
    blocks: dict[str, np.ndarray] = {}
    block_types: dict[str, str] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            raise ValueError(
                f"{gguf_path}: rope frequency factors (rope_freqs.weight, Llama 3.1) are not supported"
            )
        hf_name = hf_tensor_name(tensor.name)
        array = dequantize_tensor(tensor)
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type).name
        raw = np.asarray(tensor.data) if qtype in BLOCK_TYPES else None  # [rows, row bytes]: rows move whole
        if hf_name.endswith("q_proj.weight"):
            array = unpermute_qk(array, config["num_attention_heads"])
            raw = unpermute_qk(raw, config["num_attention_heads"]) if raw is not None else None
        elif hf_name.endswith("k_proj.weight"):
            array = unpermute_qk(array, config["num_key_value_heads"])
            raw = unpermute_qk(raw, config["num_key_value_heads"]) if raw is not None else None
        weights[hf_name] = np.ascontiguousarray(array)
        if raw is not None:
            blocks[hf_name], block_types[hf_name] = np.ascontiguousarray(raw), qtype
    expected_rows = config["vocab_size"]
    if weights["model.embed_tokens.weight"].shape != (expected_rows, config["hidden_size"]):
        raise ValueError(
            f"{gguf_path}: token_embd shape {weights['model.embed_tokens.weight'].shape} does not match "
            f"vocab_size {expected_rows} x hidden_size {config['hidden_size']}"
        )
    source = {"format": "pt", "source": Path(gguf_path).name}
    save_file(weights, str(out_dir / "model.safetensors"), metadata=source)
    del weights
    if blocks:
        save_file(blocks, str(out_dir / QUANTIZED_FILE), metadata={**block_types, "format": "ggml-blocks"})
    _write_json(out_dir / "config.json", config)
    (out_dir / "tokenizer.json").write_text(build_tokenizer(meta).to_str(), encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta, config["max_position_embeddings"]))
    _write_json(out_dir / "generation_config.json", generation_config(meta))


def read_metadata(reader: Any) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{LAYER_TENSORS[parts[2]]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")


def dequantize_tensor(tensor: Any) -> np.ndarray:
    """float32 array in numpy (row-major) order: GGUF lists dimensions innermost first."""
    import gguf

    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    if qtype.name not in SUPPORTED_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {qtype.name}, which pdserve does not dequantize "
            f"(supported: {', '.join(SUPPORTED_TYPES)})"
        )
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return gguf.quants.dequantize(tensor.data, qtype).astype(np.float32, copy=False).reshape(shape)


def permute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's HF -> GGUF row order: each head's two rotary halves become interleaved pairs."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of `permute_qk`: GGUF's interleaved rotary pairs back to HF's two halves per head."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_config(meta: dict[str, Any], tensor_names: list[str]) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks 'llama.{name}'")
        return value

    hidden, num_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = meta.get("llama.attention.key_length") or key("rope.dimension_count", hidden // num_heads)
    vocab_size = meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(key("attention.head_count_kv", num_heads)),
        "head_dim": int(head_dim),
        "vocab_size": int(vocab_size),
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    scaling = meta.get("llama.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    for name, meta_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                           ("pad_token_id", "padding_token_id")):
        if (value := meta.get(f"tokenizer.ggml.{meta_key}")) is not None:
            config[name] = int(value)
    return config


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
