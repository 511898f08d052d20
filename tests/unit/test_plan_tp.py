"""`pdserve plan` with tensor-parallel replicas: the step-time transform (split n ways plus two all-reduces per
layer), the memory of a device against what a sharded model really holds, the KV heads per rank against the
engine's shard plan, devices counted per rank, and the refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdserve.latency_model import DecodeModel, LatencyModel, PrefillModel
from pdserve.models.config import model_config_from_hf
from pdserve.models.tiny import TINY_CONFIG
from pdserve.plan import PlanInput, kv_bytes_per_token, plan, roofline_model, weight_bytes
from pdserve.plan_tp import AllReduceCost, local_kv_heads, tensor_parallel_model
from pdserve.services.cli import main

SMOLLM2 = {**TINY_CONFIG, "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "head_dim": 64,
           "tie_word_embeddings": True}
MODEL = LatencyModel(PrefillModel(0.01, 1e-4, 1e-8, 2e-8), DecodeModel(0.02, 1e-3, 1e-6), kv_bytes_per_token=4096)
LINK = AllReduceCost(latency_s=20e-6, bandwidth_bytes_s=100e9)
INPUT = PlanInput(memory_bytes=2**30, ttft_slo_s=0.5, tpot_slo_s=0.05, rate_rps=4.0, prompt_tokens=256,
                  output_tokens=128, allreduce=LINK)
ARGS = ["plan", "--model", "tiny", "--memory", "1GiB", "--ttft-ms", "500", "--tpot-ms", "50",
        "--flops", "1e11", "--bandwidth", "2e10"]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_step_is_split_n_ways_plus_two_all_reduces_per_layer(n):
    config = model_config_from_hf(SMOLLM2)
    tp = tensor_parallel_model(MODEL, config, n, 4, LINK)
    ring = 2 * (n - 1) / n
    for batch, context in ((1, 1024), (16, 16 * 1024)):
        # 60 all-reduces of batch x 576 fp32 values
        comm = 60 * (20e-6 + ring * batch * 576 * 4 / 100e9)
        assert tp.decode_step_s(batch, context) == pytest.approx(MODEL.decode_step_s(batch, context) / n + comm)
    for tokens, cached in ((256, 0), (2048, 512)):
        comm = 60 * (20e-6 + ring * tokens * 576 * 4 / 100e9)
        assert tp.prefill_time_s(tokens, cached) == pytest.approx(MODEL.prefill_time_s(tokens, cached) / n + comm)
    assert tp.kv_bytes_per_token == MODEL.kv_bytes_per_token  # a handoff's bytes do not change
    assert tensor_parallel_model(MODEL, config, 1, 4, LINK) is MODEL


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (8, 4), (8, 8), (32, 8), (12, 1)])
def test_kv_heads_per_device_are_the_engines_fullest_rank(heads, kv_heads):
    from pdserve.models.tensor_parallel import shard_plan

    config = model_config_from_hf({**TINY_CONFIG, "num_attention_heads": heads, "num_key_value_heads": kv_heads})
    for n in range(1, heads + 1):
        fullest = max(len(shard_plan(config, rank, n).kv_heads) for rank in range(n))
        assert local_kv_heads(config, n) == fullest, n


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_devices_weights_are_what_the_sharded_driver_rank_holds(tmp_path, n):
    import torch

    from pdserve.models.loader import load_model
    from pdserve.models.tensor_parallel import shard_model
    from pdserve.models.tiny import ensure_tiny_checkpoint

    model, config = load_model(ensure_tiny_checkpoint(tmp_path), torch.float32, "cpu", pack_weights=False)
    shard_model(model, 0, n, group=None)
    held = {t.data_ptr(): t.numel() * t.element_size() for t in model.parameters()}
    p = plan(config, dataclasses.replace(INPUT, decode_tensor_parallel_size=n), MODEL, MODEL, "profile")
    assert p.weight_bytes == sum(held.values())
    assert p.kv_pool_bytes == int(2**30 * 0.9) - p.weight_bytes
    per_device_token = kv_bytes_per_token(config, 4) * local_kv_heads(config, n) // config.num_kv_heads
    assert p.max_kv_tokens == p.kv_pool_bytes // (per_device_token * 16) * 16


def test_devices_count_every_rank_and_tp1_is_the_plan_as_before():
    config = model_config_from_hf(SMOLLM2)
    roofline = roofline_model(config, 4, 1e13, 1e12, read_bytes=weight_bytes(config, "float32")[1])
    one = plan(config, dataclasses.replace(INPUT, allreduce=None), roofline, roofline, "roofline")
    assert (one.prefill_devices, one.decode_devices) == (one.prefill_replicas, one.decode_replicas)
    tp = plan(config, dataclasses.replace(INPUT, prefill_tensor_parallel_size=2, decode_tensor_parallel_size=4),
              roofline, roofline, "roofline")
    assert tp.prefill_devices == pytest.approx(2 * tp.prefill_replicas)
    assert tp.decode_devices == pytest.approx(4 * tp.decode_replicas)
    assert tp.prefill_s == pytest.approx(tensor_parallel_model(roofline, config, 2, 4, LINK).prefill_time_s(256))
    assert tp.max_kv_tokens > one.max_kv_tokens  # four devices' memory, one KV head each
    with pytest.raises(ValueError, match="needs the all-reduce cost"):
        plan(config, dataclasses.replace(INPUT, decode_tensor_parallel_size=2, allreduce=None), roofline, roofline,
             "roofline")


def test_cli_plan_with_ranks(capsys):
    tp = ["--decode-tensor-parallel-size", "2", "--allreduce-latency-us", "20", "--allreduce-bandwidth", "1e11"]
    assert main([*ARGS, *tp, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decode_tensor_parallel_size"] == 2 and out["prefill_tensor_parallel_size"] == 1
    assert out["decode_devices"] == pytest.approx(2 * out["decode_replicas"])
    assert main([*ARGS, *tp]) == 0
    text = capsys.readouterr().out
    assert "tensor parallel: 1 ranks per prefill replica, 2 per decode replica" in text
    assert "GiB per device (float32)" in text
    assert main([*ARGS, "--decode-tensor-parallel-size", "2"]) == 2
    assert "needs the all-reduce cost (--allreduce-latency-us and --allreduce-bandwidth)" in capsys.readouterr().err
    assert main([*ARGS, *tp, "--measure"]) == 2
    assert "--measure runs the model in one process" in capsys.readouterr().err
