"""SystemConfig's sections (prefill, decode, router, kvstore) are overrides typed by the real configs: a
typo or a bad value anywhere is refused when the file is read, named by its path; valid sections still
merge over the system's bases into the same WorkerConfig, RouterConfig and KVStoreConfig as before."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from pdserve.services.app import SystemConfig, config_errors
from pdserve.services.cli import serve_parser
from pdserve.services.serve import ConfigError, system_config as _config
from pdserve.services.kvstore.config import KVStoreConfig
from pdserve.services.router.config import RouterConfig
from pdserve.placement.policy import PlacementConfig
from pdserve.services.worker import WorkerConfig


def _refused(raw: dict) -> ValidationError:
    with pytest.raises(ValidationError) as caught:
        SystemConfig.model_validate(raw)
    return caught.value


@pytest.mark.parametrize(("raw", "path", "near"), [
    ({"prefill": {"max_num_batched_tokenz": 512}}, ("prefill", "max_num_batched_tokenz"), "max_num_batched_tokens"),
    ({"decode": {"max_num_seqz": 8}}, ("decode", "max_num_seqz"), "max_num_seqs"),
    ({"router": {"max_inflght": 8}}, ("router", "max_inflght"), "max_inflight"),
    ({"kvstore": {"ttl": 60}}, ("kvstore", "ttl"), "ttl_s"),
    ({"router": {"placement": {"polcy": "kv_aware"}}}, ("router", "placement", "polcy"), "policy"),
    ({"decode": {"speculative": {"num_speculative_token": 4}}}, ("decode", "speculative", "num_speculative_token"),
     "num_speculative_tokens"),
    ({"decod": {"max_num_seqs": 8}}, ("decod",), "decode"),
])
def test_an_unknown_key_is_refused_by_its_path(raw, path, near):
    exc = _refused(raw)
    assert [e["loc"] for e in exc.errors()] == [path]
    assert config_errors(exc) == [f"{'.'.join(path)}: unknown key (did you mean {near}?)"]


@pytest.mark.parametrize(("raw", "line"), [
    ({"decode": {"max_num_seqs": 0}}, "decode.max_num_seqs: Input should be greater than or equal to 1 (got 0)"),
    ({"prefill": {"dtype": "fp64"}}, "prefill.dtype: Input should be "),
    ({"router": {"placement": {"policy": "fastest"}}}, "router.placement.policy: unknown placement policy 'fastest'"),
    ({"router": {"placement": {"reject_factor": 0.5}}}, "router.placement.reject_factor: Input should be greater"),
    ({"kvstore": {"maxmemory_policy": "lru"}}, "kvstore.maxmemory_policy: Input should be "),
    ({"decode": 8}, "decode: Input should be a valid dictionary"),
])
def test_a_bad_value_is_refused_by_its_path(raw, line):
    (message,) = config_errors(_refused(raw))
    assert message.startswith(line)


def test_every_error_of_a_file_is_reported(tmp_path):
    path = tmp_path / "system.yaml"
    path.write_text("model: tiny\ndecode:\n  max_num_seqz: 8\nkvstore:\n  ttl_s: 0\n")
    with pytest.raises(ValidationError) as caught:
        SystemConfig.from_yaml(path)
    lines = config_errors(caught.value)
    assert lines[0] == "decode.max_num_seqz: unknown key (did you mean max_num_seqs?)"
    assert lines[1].startswith("kvstore.ttl_s: Input should be greater than or equal to 1")


def test_serve_names_the_file_and_the_key(tmp_path):
    path = tmp_path / "system.yaml"
    path.write_text("decode:\n  max_num_seqz: 8\n")
    with pytest.raises(ConfigError) as caught:
        _config(serve_parser().parse_args(["--config", str(path)]), None)
    assert str(caught.value) == f"{path}: decode.max_num_seqz: unknown key (did you mean max_num_seqs?)"
    with pytest.raises(ConfigError, match="invalid YAML"):
        path.write_text("decode: {max_num_seqs: 8\n")
        _config(serve_parser().parse_args(["--config", str(path)]), None)
    with pytest.raises(ConfigError, match="cannot read"):
        _config(serve_parser().parse_args(["--config", str(tmp_path / "missing.yaml")]), None)
    with pytest.raises(ConfigError, match=r"^decode\.num_replicas: Input should be greater"):
        _config(serve_parser().parse_args(["--decode-replicas", "-1"]), None)


RAW = {
    "model": "tiny", "transport": "redis", "redis_url": "redis://127.0.0.1:7777/0", "kv_cache_dtype": "int8",
    "tracing_env": {"OTEL_SERVICE_NAME": "pd"},
    "prefill": {"num_replicas": 2, "max_num_batched_tokens": "512", "transport": "ucx"},
    "decode": {"max_num_seqs": 8, "speculative": {"num_speculative_tokens": 6}, "label_selector": {"pool": "hbm"}},
    "router": {"api_keys": ["k1"], "num_cpus": 0.25, "placement": {"policy": "kv_aware", "kv_aware_load_slack": 3}},
    "kvstore": {"ttl_s": 60, "maxmemory_bytes": 1 << 30},
}


def test_sections_keep_only_the_keys_they_set():
    config = SystemConfig.model_validate(RAW)
    assert config.prefill == {"num_replicas": 2, "max_num_batched_tokens": 512, "transport": "ucx"}
    assert config.decode == RAW["decode"]
    assert config.router == {"api_keys": ("k1",), "num_cpus": 0.25,
                             "placement": {"policy": "kv_aware", "kv_aware_load_slack": 3}}
    assert config.kvstore == RAW["kvstore"]
    assert SystemConfig().prefill == SystemConfig().router == {}
    assert SystemConfig.model_validate(config.model_dump()) == config


def test_valid_sections_merge_over_the_bases_as_before():
    config = SystemConfig.model_validate(RAW)
    bases = {"model": "tiny", "transport": "redis", "tracing_env": {"OTEL_SERVICE_NAME": "pd"},
             "kv_cache_dtype": "int8", "redis_url": "redis://127.0.0.1:7777/0"}
    for role in ("prefill", "decode"):  # the merge the untyped sections had
        assert config.worker(role) == WorkerConfig.model_validate({**bases, **RAW[role]})
    prefill, decode = config.worker("prefill"), config.worker("decode")
    assert (prefill.transport, prefill.num_replicas, prefill.max_num_batched_tokens) == ("ucx", 2, 512)
    assert (decode.transport, decode.kv_cache_dtype, decode.redis_url) == ("redis", "int8", RAW["redis_url"])
    assert decode.engine_config().speculative.num_speculative_tokens == 6
    assert config.kvstore_config() == KVStoreConfig(redis_url=RAW["redis_url"], ttl_s=60, maxmemory_bytes=1 << 30)
    router_bases = {"model": "tiny", "served_model_name": config.served_model_name, "mode": "disaggregated",
                    "tracing_env": {"OTEL_SERVICE_NAME": "pd"}}
    router = RouterConfig.model_validate({**router_bases, **config.router})  # as build_system builds it
    assert router == RouterConfig.model_validate({**router_bases, **RAW["router"]})
    assert router.api_keys == ("k1",) and router.num_cpus == 0.25
    assert PlacementConfig.model_validate(router.placement) == PlacementConfig(policy="kv_aware", kv_aware_load_slack=3)


def test_the_config_validates_without_torch_or_ray():
    """`pdserve serve` refuses a bad file in well under a second because checking it imports neither."""
    code = ("import sys; import pdserve.services.app, pdserve.services.cli; "
            "sys.exit(1 if {'torch', 'ray'} & set(sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_step_budget_defaults_by_device_and_a_set_one_wins():
    from pdserve.services.worker import CPU_MAX_NUM_BATCHED_TOKENS

    cpu, gpu = WorkerConfig(), WorkerConfig(device="cuda")
    assert cpu.max_num_batched_tokens is None and CPU_MAX_NUM_BATCHED_TOKENS == 512
    assert cpu.engine_config().scheduler.max_num_batched_tokens == 512
    assert gpu.resolved_max_num_batched_tokens() == 2048
    assert WorkerConfig(max_num_batched_tokens=4096).engine_config().scheduler.max_num_batched_tokens == 4096
    with pytest.raises(ValidationError):
        WorkerConfig(max_num_batched_tokens=0)
