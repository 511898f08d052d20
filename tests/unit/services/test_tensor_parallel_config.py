"""tensor_parallel_size per role: validated where the config is read (named by its key), set on both roles by
`pdserve serve --tensor-parallel-size`, passed to each role's engine and to Ray as one CPU share per rank, and
and accepted on roles that hand KV off, with any KV cache dtype."""

from __future__ import annotations


import pytest
from pydantic import ValidationError

from pdserve.services.app import SystemConfig, config_errors
from pdserve.services.cli import serve_parser
from pdserve.services.cpu_shares import fit_cpu_shares
from pdserve.services.serve import ConfigError, check_tensor_parallel, run, system_config, tensor_parallel_sizes



def _errors(raw: dict) -> list[str]:
    with pytest.raises(ValidationError) as caught:
        SystemConfig.model_validate(raw)
    return config_errors(caught.value)


def test_colocated_decode_reaches_the_engine_and_asks_ray_for_a_share_per_rank():
    config = SystemConfig(mode="colocated", decode={"tensor_parallel_size": 2, "num_cpus": 1.5})
    worker = config.worker("decode")
    engine = worker.engine_config()
    assert (engine.tensor_parallel_size, engine.num_threads) == (2, 1)  # each rank runs int(num_cpus) threads
    assert worker.deployment_options()["ray_actor_options"]["num_cpus"] == 3.0
    assert SystemConfig().worker("decode").actor_options()["num_cpus"] == 1.0
    assert SystemConfig().worker("decode").engine_config().tensor_parallel_size == 1
    assert tensor_parallel_sizes(config) == {"decode": 2}  # colocated: no prefill pool
    assert tensor_parallel_sizes(SystemConfig()) == {"prefill": 1, "decode": 1}


@pytest.mark.parametrize("raw", [
    {"decode": {"tensor_parallel_size": 2}},
    {"prefill": {"tensor_parallel_size": 4}},
    {"prefill": {"tensor_parallel_size": 2}, "decode": {"tensor_parallel_size": 1}},
    {"prefill": {"tensor_parallel_size": 2}, "decode": {"tensor_parallel_size": 2}},
])
def test_roles_that_hand_kv_off_take_any_degrees_and_kv_cache_dtypes(raw):
    for kv_cache_dtype in ("auto", "int8", "fp8_e4m3"):
        config = SystemConfig.model_validate({**raw, "kv_cache_dtype": kv_cache_dtype})
        assert config.mode == "disaggregated"
        assert tensor_parallel_sizes(config) == {role: raw.get(role, {}).get("tensor_parallel_size", 1)
                                                 for role in ("prefill", "decode")}
        assert all(config.worker(r).kv_handoff and config.worker(r).kv_cache_dtype == kv_cache_dtype
                   for r in ("prefill", "decode"))
    # colocated without the redis tier hands no KV: its workers keep no whole-model pool
    assert not SystemConfig(mode="colocated", decode={"tensor_parallel_size": 2}).worker("decode").kv_handoff


def test_what_the_ranks_cannot_run_is_refused_naming_the_key():
    assert _errors({"mode": "colocated", "decode": {"tensor_parallel_size": 0}}) == [
        "decode.tensor_parallel_size: Input should be greater than or equal to 1 (got 0)"]
    (line,) = _errors({"mode": "colocated", "decode": {"tensor_parallel_size": 2, "device": "cuda"}})
    assert line == ("decode.tensor_parallel_size: above 1 the ranks run on CPU over gloo only; device 'cuda' would "
                    "need NCCL, which is not wired yet (got 2)")
    (line,) = _errors({"mode": "colocated", "decode": {"tensor_parallel_size": 2, "quantization": "int8"}})
    assert line.startswith("decode.tensor_parallel_size: above 1 the ranks serve unquantized weights only"), line
    redis = {"mode": "colocated", "transport": "redis", "redis_url": "redis://127.0.0.1:1/0"}
    assert SystemConfig(**redis, decode={"tensor_parallel_size": 2}).worker("decode").kv_handoff
    # colocated runs no prefill pool: its section is not checked
    assert SystemConfig(mode="colocated", prefill={"tensor_parallel_size": 2}).mode == "colocated"


def test_the_flag_sets_both_roles_over_the_file(tmp_path):
    path = tmp_path / "system.yaml"
    path.write_text("mode: colocated\ndecode: {tensor_parallel_size: 3, max_num_seqs: 8}\n")
    from_file = system_config(serve_parser().parse_args(["--config", str(path)]), None)
    assert tensor_parallel_sizes(from_file) == {"decode": 3}
    flagged = system_config(serve_parser().parse_args(["--config", str(path), "--tensor-parallel-size", "2"]), None)
    assert tensor_parallel_sizes(flagged) == {"decode": 2} and flagged.worker("decode").max_num_seqs == 8
    both = system_config(serve_parser().parse_args(["--tensor-parallel-size", "2"]), None)
    assert tensor_parallel_sizes(both) == {"prefill": 2, "decode": 2}
    quantized = system_config(serve_parser().parse_args(["--tensor-parallel-size", "2", "--kv-cache-dtype", "int8"]),
                              None)
    assert quantized.worker("prefill").engine_config().cache.kv_cache_dtype == "int8"


def test_a_split_the_model_cannot_take_is_refused_before_ray(capsys):
    args = ["--model", "tiny", "--mode", "colocated", "--port", "1"]
    config = system_config(serve_parser().parse_args([*args, "--tensor-parallel-size", "2"]), None)
    check_tensor_parallel(config)  # tiny: 8 heads over 4 KV heads
    too_many = system_config(serve_parser().parse_args([*args, "--tensor-parallel-size", "9"]), None)
    with pytest.raises(ConfigError, match="tensor_parallel_size 9 of tiny: tensor_parallel_size 9 exceeds the "
                                          "model's 8 attention heads: a rank would own no head"):
        check_tensor_parallel(too_many)
    assert run(serve_parser().parse_args([*args, "--tensor-parallel-size", "9"])) == 2
    assert "pdserve serve: tensor_parallel_size 9 of tiny: tensor_parallel_size 9 exceeds" in capsys.readouterr().err


def test_cpu_shares_count_every_rank():
    config = SystemConfig(mode="colocated", decode={"tensor_parallel_size": 2})
    shares = fit_cpu_shares(config, 2)
    assert shares.decode == pytest.approx(0.85) and shares.used == pytest.approx(1.95)
    assert shares.describe() == ("CPU split of the 2 CPUs Ray sees: router 1 x 0.25, decode 1 x 2 ranks x 0.85 "
                                 "(1.95 used)")
    applied = shares.apply(config).worker("decode")
    assert applied.actor_options()["num_cpus"] == pytest.approx(1.7) and applied.engine_config().num_threads == 1
    stated = fit_cpu_shares(SystemConfig(mode="colocated", decode={"tensor_parallel_size": 2, "num_cpus": 2}), 8)
    assert stated.used == pytest.approx(4.5)  # 0.5 router + 2 ranks x 2


def test_the_default_quantization_auto_serves_the_model_dtype_on_tensor_parallel_ranks():
    """`auto` (the serving default) never refuses a split: the ranks load float weights, and a quantization
    named outright is still refused."""
    from pdserve.config import EngineConfig

    engine = SystemConfig(decode={"tensor_parallel_size": 2}).worker("decode").engine_config()
    assert (engine.quantization, engine.weight_quantization) == ("auto", "none")
    assert EngineConfig(quantization="auto").weight_quantization == "auto"
    with pytest.raises(ValueError, match="unquantized weights on CPU"):
        EngineConfig(quantization="int4", tensor_parallel_size=2)
