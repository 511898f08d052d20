"""`pdserve plan` with weight-only quantization: bytes per parameter held and read per decode step."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.models.config import model_config_from_hf
from pdserve.models.tiny import TINY_CONFIG
from pdserve.plan import PlanInput, latency_model_for, num_packed_parameters, num_parameters, plan, weight_bytes
from pdserve.services.cli import main

SMOLLM2 = {**TINY_CONFIG, "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "head_dim": 64,
           "tie_word_embeddings": True}
INPUT = PlanInput(memory_bytes=2**30, ttft_slo_s=0.5, tpot_slo_s=0.05, rate_rps=1.0, prompt_tokens=256,
                  output_tokens=128)


def test_smollm2_bytes_per_mode():
    config = model_config_from_hf(SMOLLM2)
    head = embedding = 49152 * 576
    linears = 30 * 3_538_944  # qkv 576x960, o 576x576, gate_up 576x3072, down 1536x576 per layer
    assert num_packed_parameters(config) == linears + head
    norms = num_parameters(config) - linears - embedding
    assert norms == 61 * 576
    # fp32: the tied embedding is held twice (table and LM head), read once (as the LM head)
    assert weight_bytes(config, "float32") == ((linears + head + norms + embedding) * 4, (linears + head + norms) * 4)
    # int4: 0.5 B codes + 4 B float16 scale and offset per 32, held once and read whole; head int8
    assert weight_bytes(config, "float32", "int4") == (
        round(linears * 0.625 + head * 1.125 + (norms + embedding) * 4), round(linears * 0.625 + head * 1.125 + norms * 4))
    # int8 (Q8_0): 1 + 4/32
    assert weight_bytes(config, "float32", "int8")[1] == round((linears + head) * 1.125 + norms * 4)
    assert weight_bytes(config, "bfloat16", "fp8")[1] == (linears + head) + norms * 2
    # what the engine counts on the GGUF under auto with the native kernel (pdserve.models.served): 98.3 MB
    assert weight_bytes(config, "float32", "int4")[1] == pytest.approx(98.3e6, rel=0.001)


def test_a_quantized_linear_is_never_packed_and_unknown_modes_are_refused():
    config = model_config_from_hf(TINY_CONFIG)
    assert weight_bytes(config, "float32", "int8", packed_weights=True) == weight_bytes(config, "float32", "int8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        weight_bytes(config, "float32", "int3")


def test_plan_memory_and_roofline_follow_the_quantization():
    config = model_config_from_hf(SMOLLM2)
    fp32, _ = latency_model_for(None, "decode", config, "float32", 1e11, 1e10)
    int4, _ = latency_model_for(None, "decode", config, "float32", 1e11, 1e10, quantization="int4")
    assert fp32.decode.a == pytest.approx(weight_bytes(config, "float32")[1] / 1e10)
    assert int4.decode.a == pytest.approx(weight_bytes(config, "float32", "int4")[1] / 1e10)
    p_fp32 = plan(config, INPUT, fp32, fp32, "roofline")
    p_int4 = plan(config, dataclasses.replace(INPUT, quantization="int4"), int4, int4, "roofline")
    assert p_int4.weight_bytes == weight_bytes(config, "float32", "int4")[0]
    assert p_int4.kv_pool_bytes - p_fp32.kv_pool_bytes == p_fp32.weight_bytes - p_int4.weight_bytes
    # at 10 GB/s a fp32 step (538 MB) misses a 50 ms TPOT, an int4 one (102 MB) meets it
    assert p_fp32.decode_batch == 0 and p_int4.decode_batch > 0


def test_cli_json_has_the_read_bytes(capsys):
    args = ["plan", "--model", "tiny", "--memory", "1GiB", "--ttft-ms", "500", "--tpot-ms", "50",
            "--flops", "1e11", "--bandwidth", "1e10", "--json"]
    assert main(args) == 0
    none = json.loads(capsys.readouterr().out)
    assert main([*args, "--quantization", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    config = model_config_from_hf(TINY_CONFIG)
    assert (none["weight_bytes"], none["weight_read_bytes"]) == weight_bytes(config, "float32")
    assert (int8["weight_bytes"], int8["weight_read_bytes"]) == weight_bytes(config, "float32", "int8")
    assert main(args[:-1] + ["--quantization", "int4"]) == 0
    assert "linears int4" in capsys.readouterr().out
