"""`pdserve plan` and the latency model with a quantized KV cache: the same bytes per token as the pool."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pdserve.services.cli import main
from pdserve.kvcache.layout import layout_of
from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel, TransferModel
from pdserve.models.config import model_config_from_hf
from pdserve.models.tiny import TINY_CONFIG
from pdserve.plan import latency_model_for, kv_bytes_per_token, roofline_model

SMOLLM_LIKE = {**TINY_CONFIG, "num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64,
               "num_attention_heads": 9, "hidden_size": 576}
ARGS = ["plan", "--model", "tiny", "--memory", "1GiB", "--ttft-ms", "500", "--tpot-ms", "50", "--rate", "10", "--json"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype,dtype_bytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_plan_counts_the_bytes_the_pool_holds(kv_cache_dtype, dtype, dtype_bytes):
    config = model_config_from_hf(SMOLLM_LIKE)
    assert kv_bytes_per_token(config, dtype_bytes, kv_cache_dtype) == layout_of(config, dtype, 16, kv_cache_dtype).bytes_per_token


def test_int8_is_66_of_128_bytes_per_row_of_bf16():
    config = model_config_from_hf(SMOLLM_LIKE)
    assert kv_bytes_per_token(config, 2, "int8") == 2 * 30 * 3 * 66
    assert kv_bytes_per_token(config, 2, "int8") / kv_bytes_per_token(config, 2) == pytest.approx(66 / 128)


def test_roofline_decode_reads_fewer_kv_bytes():
    config = model_config_from_hf(SMOLLM_LIKE)
    full = roofline_model(config, 2, flops=1e12, bandwidth=1e11)
    int8 = roofline_model(config, 2, flops=1e12, bandwidth=1e11, kv_cache_dtype="int8")
    assert int8.decode.c == pytest.approx(full.decode.c * 66 / 128)
    assert int8.decode.a == full.decode.a


def test_profiled_transfer_term_uses_the_quantized_size(tmp_path):
    config = model_config_from_hf(TINY_CONFIG)
    model = LatencyModel(PrefillModel(0.01, 1e-4, 0.0), DecodeModel(0.02, 1e-3, 1e-6),
                         kv_bytes_per_token=kv_bytes_per_token(config, 4), transfers={"ucx": TransferModel(1e-4, 1e9)})
    LatencyProfile({"default": model}).save(tmp_path / "p.json")
    full, _ = latency_model_for(str(tmp_path / "p.json"), "decode", config, "float32", None, None)
    int8, _ = latency_model_for(str(tmp_path / "p.json"), "decode", config, "float32", None, None, "int8")
    assert int8.kv_bytes_per_token == kv_bytes_per_token(config, 4, "int8") < full.kv_bytes_per_token
    assert int8.kv_transfer_s(1000, "ucx") < full.kv_transfer_s(1000, "ucx")
    assert int8.decode == full.decode  # a measured fit stays as measured
    assert dataclasses.replace(int8, kv_bytes_per_token=full.kv_bytes_per_token) == full


def test_cli_plan_with_int8_holds_more_tokens(capsys):
    roofline = ["--flops", "1e11", "--bandwidth", "2e10"]
    assert main([*ARGS, *roofline]) == 0
    full = json.loads(capsys.readouterr().out)
    assert main([*ARGS, *roofline, "--kv-cache-dtype", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert int8["kv_bytes_per_token"] < full["kv_bytes_per_token"]
    assert int8["max_kv_tokens"] > 3 * full["max_kv_tokens"]  # fp32 model: 4-byte values become 1 + scales
