"""`pdserve bench engine`'s bytes per batch-1 decode step, on the tiny model: the served weights' bytes
(quantized codes and kernel scales, or float weights) plus every context token's K/V. No timing."""

from __future__ import annotations

import pytest

from pdserve.bench.engine import decode_step_read_bytes
from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine import LLM
from pdserve.models.tiny import TINY_CONFIG

KV_PER_TOKEN = 2 * TINY_CONFIG["num_hidden_layers"] * TINY_CONFIG["num_key_value_heads"] * 32 * 4  # K and V, fp32


def _llm(quantization: str, kv_cache_dtype: str = "auto") -> LLM:
    return LLM(EngineConfig(model="tiny", device="cpu", dtype="float32", quantization=quantization,
                            cache=CacheConfig(num_blocks=8, kv_cache_dtype=kv_cache_dtype)))


def test_float_and_int8_weights_and_the_kv_read():
    none, int8 = decode_step_read_bytes(_llm("none"), 320), decode_step_read_bytes(_llm("int8"), 320)
    assert none["kv"] == int8["kv"] == 320 * KV_PER_TOKEN == 1_310_720
    h, v = TINY_CONFIG["hidden_size"], TINY_CONFIG["vocab_size"]
    linears = 3_098_880 - 2 * v * h - (2 * TINY_CONFIG["num_hidden_layers"] + 1) * h  # no biases
    norms = (2 * TINY_CONFIG["num_hidden_layers"] + 1) * h * 4
    assert none["weights"] == (linears + v * h) * 4 + norms  # every linear, the LM head too; no embedding
    assert int8["weights"] < none["weights"] / 3.5  # 1 byte per weight + a bfloat16 scale per output row


def test_a_quantized_kv_cache_reads_fewer_kv_bytes():
    int8_kv = decode_step_read_bytes(_llm("none", "int8"), 100)["kv"]
    assert int8_kv == 100 * 2 * TINY_CONFIG["num_hidden_layers"] * TINY_CONFIG["num_key_value_heads"] * (32 + 2)


@pytest.mark.parametrize("quantization", ["bogus"])
def test_an_unknown_quantization_is_refused(quantization):
    with pytest.raises(ValueError, match="quantization must be one of"):
        _llm(quantization)
