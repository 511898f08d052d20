"""GGUF -> HF checkpoint conversion on small synthetic files: dequantization, Q/K order, tokenizer, cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from pdserve.models.gguf import (
    SUPPORTED_TYPES,
    convert_gguf,
    dequantize_tensor,
    ensure_hf_checkpoint,
    hf_config,
    permute_qk,
    unpermute_qk,
)
from pdserve.models.tokenizer import Tokenizer
from safetensors.numpy import load_file

from .conftest import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    TOKENS,
    Q,
    gguf_rows_from_hf,
    write_gguf,
)

ROWS, COLS = 6, 64  # two 32-element blocks per row


def _f16_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.uniform(0.01, 0.2, n).astype(np.float16)


def _pack_q4(d: np.ndarray, codes: np.ndarray, m: np.ndarray | None) -> np.ndarray:
    """ggml Q4 block: f16 d [, f16 m], 16 bytes; element j is the low nibble of byte j, j+16 the high one."""
    blocks = codes.reshape(-1, 32).astype(np.uint8)
    nibbles = blocks[:, :16] | (blocks[:, 16:] << 4)
    head = [d.reshape(-1, 1).view(np.uint8)]
    if m is not None:
        head.append(m.reshape(-1, 1).view(np.uint8))
    return np.concatenate([*head, nibbles], axis=1).reshape(ROWS, -1)


def _q4_0(rng):
    d, codes = _f16_scales(rng, ROWS * COLS // 32), rng.integers(0, 16, ROWS * COLS)
    expected = (codes.reshape(-1, 32) - 8) * d.astype(np.float32)[:, None]
    return _pack_q4(d, codes, None), expected


def _q4_1(rng):
    d, codes = _f16_scales(rng, ROWS * COLS // 32), rng.integers(0, 16, ROWS * COLS)
    m = rng.uniform(-1, 0, ROWS * COLS // 32).astype(np.float16)
    expected = codes.reshape(-1, 32) * d.astype(np.float32)[:, None] + m.astype(np.float32)[:, None]
    return _pack_q4(d, codes, m), expected


def _q8_0(rng):
    d, codes = _f16_scales(rng, ROWS * COLS // 32), rng.integers(-127, 128, ROWS * COLS).astype(np.int8)
    packed = np.concatenate([d.reshape(-1, 1).view(np.uint8), codes.reshape(-1, 32).view(np.uint8)], axis=1)
    return packed.reshape(ROWS, -1), codes.reshape(-1, 32) * d.astype(np.float32)[:, None]


def _f16(rng):
    values = rng.standard_normal(ROWS * COLS).astype(np.float16)
    return values.view(np.uint8).reshape(ROWS, -1), values.astype(np.float32)


def _bf16(rng):
    top = rng.standard_normal(ROWS * COLS).astype(np.float32).view(np.uint32) >> 16
    expected = (top << 16).astype(np.uint32).view(np.float32)
    return top.astype(np.uint16).view(np.uint8).reshape(ROWS, -1), expected


def _f32(rng):
    values = rng.standard_normal(ROWS * COLS).astype(np.float32)
    return values.view(np.uint8).reshape(ROWS, -1), values


ENCODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "F16": _f16, "BF16": _bf16, "F32": _f32}


def _read_tensor(path: Path):
    return gguf.GGUFReader(str(path)).tensors[0]


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_dequantize_matches_block_layout(tmp_path: Path, type_name: str) -> None:
    packed, expected = ENCODERS[type_name](np.random.default_rng(7))
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", packed, raw_dtype=Q[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = _read_tensor(tmp_path / "t.gguf")
    assert tensor.tensor_type == Q[type_name]
    out = dequantize_tensor(tensor)
    assert out.dtype == np.float32 and out.shape == (ROWS, COLS)
    np.testing.assert_allclose(out, expected.reshape(ROWS, COLS), rtol=1e-6, atol=1e-7)


def test_unsupported_type_names_type_and_tensor(tmp_path: Path, llama_gguf) -> None:
    path, _ = llama_gguf(types={"ffn_gate": Q.Q5_0})
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate\.weight' has type Q5_0.*supported: F32"):
        ensure_hf_checkpoint(path, tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if not p.name.endswith(".lock")]


def test_qk_permutation_known_case_and_round_trip() -> None:
    hf = np.arange(16, dtype=np.float32).reshape(8, 2)  # 2 heads, head_dim 4: rows 0..7
    gguf_order = permute_qk(hf, 2)
    assert gguf_order[:, 0].tolist() == [0, 4, 2, 6, 8, 12, 10, 14]  # rows 0,2,1,3 | 4,6,5,7
    np.testing.assert_array_equal(unpermute_qk(gguf_order, 2), hf)
    w = np.random.default_rng(0).standard_normal((HEADS * HEAD_DIM, 8)).astype(np.float32)
    np.testing.assert_array_equal(permute_qk(w, HEADS), gguf_rows_from_hf(w, HEADS))
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, HEADS), HEADS), w)


def test_unpermuted_rows_give_hf_rotary_what_gguf_rotary_gets() -> None:
    # llama.cpp rotates adjacent pairs (2i, 2i+1); HF rotates (i, i + D/2). Same frequency index i.
    rng = np.random.default_rng(1)
    gguf_q = rng.standard_normal((1, HEAD_DIM))
    theta = 0.7 * 10000.0 ** (-np.arange(HEAD_DIM // 2) * 2 / HEAD_DIM)
    cos, sin = np.cos(theta), np.sin(theta)
    x0, x1 = gguf_q[0, 0::2], gguf_q[0, 1::2]
    gguf_rot = np.empty(HEAD_DIM)
    gguf_rot[0::2], gguf_rot[1::2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
    hf_q = unpermute_qk(gguf_q.T, 1)[:, 0]
    half = HEAD_DIM // 2
    hf_rot = hf_q * np.tile(cos, 2) + np.concatenate([-hf_q[half:], hf_q[:half]]) * np.tile(sin, 2)
    np.testing.assert_allclose(hf_rot, unpermute_qk(gguf_rot[:, None], 1)[:, 0], atol=1e-12)


@pytest.mark.parametrize("tied", [False, True])
def test_conversion_writes_hf_checkpoint(tmp_path: Path, llama_gguf, tied: bool) -> None:
    path, hf_weights = llama_gguf(tied=tied)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(path, out)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    shape = (config["num_hidden_layers"], config["vocab_size"], config["max_position_embeddings"])
    assert shape == (LAYERS, 263, 256)
    weights = load_file(str(out / "model.safetensors"))
    assert set(weights) == set(hf_weights)
    for name, reference in hf_weights.items():
        kinds = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "embed", "lm_head")
        kind = next((k for k in kinds if k in name), None)
        assert weights[name].dtype == np.float32 and weights[name].shape == reference.shape
        # Rows are quantized independently, so HF-order weights equal the quantized HF-order reference.
        qtype = {"q_proj": Q.Q4_0, "k_proj": Q.Q4_1, "v_proj": Q.F16, "o_proj": Q.BF16, "gate_proj": Q.Q8_0,
                 "up_proj": Q.Q4_1, "embed": Q.Q8_0, "lm_head": Q.Q4_0}.get(kind, Q.F32)
        quantized = gguf.quants.quantize(reference, qtype)
        expected = gguf.quants.dequantize(quantized, qtype).reshape(reference.shape)
        np.testing.assert_array_equal(weights[name], expected, err_msg=name)
        scale = np.abs(reference).max()
        assert np.abs(weights[name] - reference).max() <= 0.15 * scale, name  # and close to the original
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": [2]}


def test_tokenizer_from_metadata(tmp_path: Path, llama_gguf) -> None:
    path, _ = llama_gguf()
    tokenizer = Tokenizer.from_dir(ensure_hf_checkpoint(path, tmp_path))
    ids = {t: i for i, t in enumerate(TOKENS)}
    text = "the thin<|im_end|> 42"
    pieces = ["t", "he", "Ġt", "h", "in", "<|im_end|>", "Ġ", "4", "2"]  # digits split one by one
    expected = [ids[p] for p in pieces]
    assert tokenizer.encode(text) == expected
    assert tokenizer.decode(expected, skip_special_tokens=False) == text
    assert tokenizer.decode(tokenizer.encode("naïve  ☃\n\tx")) == "naïve  ☃\n\tx"
    assert (tokenizer.bos_token, tokenizer.bos_token_id, tokenizer.eos_token_ids) == ("<|im_start|>", 1, {2})
    assert tokenizer.special_token_ids == {0, 1, 2}
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_loads_in_pdserve_like_transformers_gguf(tmp_path: Path, llama_gguf) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from pdserve.models.attention import AttentionMetadata, PrefillChunk
    from pdserve.models.loader import load_model

    path, _ = llama_gguf()
    model, _ = load_model(ensure_hf_checkpoint(path, tmp_path), torch.float32, "cpu")
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompt = list(range(3, 40))
    n = len(prompt)
    block = torch.zeros(3, 16, KV_HEADS, HEAD_DIM)
    caches = [(block.clone(), block.clone()) for _ in range(LAYERS)]
    meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decode_tokens=0, decode_groups=(),
                             prefills=(PrefillChunk(0, n, n, torch.arange(3)),))
    with torch.no_grad():
        ours = model.compute_logits(model(torch.tensor(prompt), torch.arange(n), caches, meta))
        theirs = reference(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert ours.std() > 0.5


def test_cache_reused_and_rebuilt_when_the_file_changes(tmp_path: Path, llama_gguf) -> None:
    path, _ = llama_gguf()
    first = ensure_hf_checkpoint(path, tmp_path)
    assert first.parent == tmp_path / "gguf" and first.name.startswith("synthetic-")
    (first / "marker").write_text("kept")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_hf_checkpoint(path, tmp_path) == first
    assert (first / "marker").exists() and (first / "model.safetensors").stat().st_mtime_ns == stamp
    llama_gguf(seed=1)  # same name and size, other weights
    second = ensure_hf_checkpoint(path, tmp_path)
    assert second != first and not (second / "marker").exists()
    assert not np.array_equal(load_file(str(first / "model.safetensors"))["model.norm.weight"],
                              load_file(str(second / "model.safetensors"))["model.norm.weight"])


def test_interrupted_conversion_is_never_visible(tmp_path: Path, llama_gguf) -> None:
    path, _ = llama_gguf()
    write_gguf(path, {"blk.0.bogus.weight": (np.zeros((2, 32), np.float32), Q.F32)})
    with pytest.raises(ValueError, match="bogus"):
        ensure_hf_checkpoint(path, tmp_path)
    assert [p.name for p in (tmp_path / "gguf").iterdir() if not p.name.endswith(".lock")] == []
    path, _ = llama_gguf()
    assert (ensure_hf_checkpoint(path, tmp_path) / "config.json").is_file()


def test_concurrent_processes_publish_one_complete_directory(tmp_path: Path, llama_gguf) -> None:
    path, _ = llama_gguf()
    code = ("import sys; from pdserve.models.gguf import ensure_hf_checkpoint; "
            "print(ensure_hf_checkpoint(sys.argv[1], sys.argv[2]))")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    command = [sys.executable, "-c", code, str(path), str(tmp_path)]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    outputs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(outputs) == 1
    target = Path(outputs.pop())
    entries = sorted(p.name for p in (tmp_path / "gguf").iterdir() if not p.name.endswith(".lock"))
    assert entries == [target.name]
    assert Tokenizer.from_dir(target).vocab_size == len(TOKENS)


def test_config_refuses_other_architectures() -> None:
    with pytest.raises(ValueError, match="architecture 'mamba'"):
        hf_config({"general.architecture": "mamba"}, [])
