"""A `tokenizers` byte-level BPE tokenizer and its configs from a GGUF file's `tokenizer.*` metadata."""

from __future__ import annotations

from typing import Any

import tokenizers
from pdserve.models.tiny import byte_alphabet
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SUPPORTED_PRE = ("default", "gpt2", "smollm", "llama-bpe", "llama3")


def build_tokenizer(meta: dict[str, Any]) -> tokenizers.Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' byte-level BPE)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    alphabet = set(byte_alphabet())
    spell = byte_alphabet()
    vocab = {
        # a normal token outside the byte alphabet is spelled as its UTF-8 bytes, as in tokenizer.json
        token if ttype != NORMAL or set(token) <= alphabet else "".join(spell[b] for b in token.encode()): i
        for i, (token, ttype) in enumerate(zip(tokens, types))
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    tokenizer.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre") or "default", prefix_space)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    )
    return tokenizer


def _pre_tokenizer(pre: str, prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=True)
    if pre in ("default", "gpt2"):
        return byte_level
    if pre == "smollm":  # llama.cpp and the original tokenizer.json split every digit first
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, use_regex=False),
        ])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(SUPPORTED_PRE)})")


def _token(meta: dict[str, Any], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else meta["tokenizer.ggml.tokens"][int(token_id)]


def tokenizer_config(meta: dict[str, Any], max_length: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        if (token := _token(meta, key)) is not None:
            config[name] = token
    if (template := meta.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    return config


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    keys = (f"tokenizer.ggml.{k}" for k in ("eos_token_id", "eot_token_id"))
    eos = [int(meta[k]) for k in keys if k in meta]
    config: dict[str, Any] = {"eos_token_id": sorted(set(eos))}
    if (bos := meta.get("tokenizer.ggml.bos_token_id")) is not None:
        config["bos_token_id"] = int(bos)
    return config
