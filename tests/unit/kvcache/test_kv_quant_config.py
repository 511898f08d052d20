"""kv_cache_dtype per role: WorkerConfig carries it to the engine, SystemConfig and `pdserve serve` set it
for both roles, and roles that disagree are refused at config time (their handoffs could never succeed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.services.app import SystemConfig
from pdserve.services.cli import serve_parser
from pdserve.services.serve import system_config as _config
from pdserve.services.worker import WorkerConfig


def test_worker_config_reaches_the_cache_config():
    assert WorkerConfig().engine_config().cache.kv_cache_dtype == "float16"  # a float32 model on CPU
    assert WorkerConfig(kv_cache_dtype="auto").engine_config().cache.kv_cache_dtype == "auto"
    assert WorkerConfig(kv_cache_dtype="int8").engine_config().cache.kv_cache_dtype == "int8"
    assert WorkerConfig(dtype="bfloat16").engine_config().cache.kv_cache_dtype == "float16"  # on CPU whatever the dtype
    assert WorkerConfig(device="cuda").resolved_kv_cache_dtype() == "auto"
    with pytest.raises(ValidationError):
        WorkerConfig(kv_cache_dtype="int4")


def test_system_config_sets_both_roles():
    config = SystemConfig(kv_cache_dtype="int8")
    assert config.worker("prefill").kv_cache_dtype == config.worker("decode").kv_cache_dtype == "int8"
    same = SystemConfig(prefill={"kv_cache_dtype": "fp8_e4m3"}, decode={"kv_cache_dtype": "fp8_e4m3"})
    assert same.worker("decode").kv_cache_dtype == "fp8_e4m3"


@pytest.mark.parametrize("overrides", [
    {"decode": {"kv_cache_dtype": "int8"}},
    {"kv_cache_dtype": "int8", "prefill": {"kv_cache_dtype": "auto"}},
    {"prefill": {"kv_cache_dtype": "int8"}, "decode": {"kv_cache_dtype": "fp8_e4m3"}},
])
def test_roles_that_disagree_are_refused(overrides):
    with pytest.raises(ValidationError, match="KV cache dtypes differ"):
        SystemConfig(**overrides)


def test_colocated_mode_has_one_role_and_nothing_to_agree_on():
    assert SystemConfig(mode="colocated", decode={"kv_cache_dtype": "int8"}).worker("decode").kv_cache_dtype == "int8"


def test_serve_flag_sets_both_roles():
    args = serve_parser().parse_args(["--model", "tiny", "--kv-cache-dtype", "int8"])
    config = _config(args, None)
    assert config.worker("prefill").kv_cache_dtype == config.worker("decode").kv_cache_dtype == "int8"
    default = _config(serve_parser().parse_args(["--model", "tiny"]), None)
    assert default.kv_cache_dtype is None
    assert default.worker("prefill").resolved_kv_cache_dtype() == default.worker("decode").resolved_kv_cache_dtype() == "float16"


def test_float16_on_a_gpu_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match="kv_cache_dtype") as err:
        WorkerConfig(device="cuda", kv_cache_dtype="float16")
    assert "CPU" in str(err.value)
    with pytest.raises(ValueError, match="float16"):
        from pdserve.config import CacheConfig, EngineConfig

        EngineConfig(device="cuda", cache=CacheConfig(kv_cache_dtype="float16"))


def test_the_default_and_an_explicit_float16_agree():
    assert SystemConfig(prefill={"kv_cache_dtype": "float16"}).worker("decode").resolved_kv_cache_dtype() == "float16"
    with pytest.raises(ValidationError, match="KV cache dtypes differ"):
        SystemConfig(prefill={"kv_cache_dtype": "auto"})
