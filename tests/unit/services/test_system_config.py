"""The one validated config the whole system is composed from."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

pytest.importorskip("ray")
from pdserve.services.app import SystemConfig  # noqa: E402


def test_worker_configs_inherit_model_transport_and_redis(tmp_path):
    path = tmp_path / "system.yaml"
    path.write_text(
        "mode: disaggregated\ntransport: redis\nredis_url: redis://127.0.0.1:7777/0\n"
        "prefill: {num_replicas: 2, num_cpus: 2}\ndecode: {max_num_seqs: 8}\n"
    )
    config = SystemConfig.from_yaml(path)
    prefill, decode = config.worker("prefill"), config.worker("decode")
    assert (prefill.transport, prefill.redis_url, prefill.num_replicas) == ("redis", "redis://127.0.0.1:7777/0", 2)
    assert prefill.engine_config().num_threads == 2 and prefill.actor_options()["num_cpus"] == 2.0
    assert decode.max_num_seqs == 8 and decode.num_replicas == 1
    assert decode.deployment_options()["max_ongoing_requests"] == 128
    assert config.kvstore_config().redis_url == "redis://127.0.0.1:7777/0"


def test_worker_scheduling_switches_reach_the_engine():
    worker = SystemConfig(decode={"enable_chunked_prefill": False, "max_num_batched_tokens": 256,
                                  "enable_prefix_caching": False}).worker("decode")
    engine = worker.engine_config()
    assert engine.scheduler.enable_chunked_prefill is False and engine.scheduler.max_num_batched_tokens == 256
    assert engine.cache.enable_prefix_caching is False


def test_invalid_configs_are_rejected():
    with pytest.raises(ValidationError):
        SystemConfig.model_validate({"mode": "sideways"})
    with pytest.raises(ValidationError):
        SystemConfig.model_validate({"unknown": 1})
    with pytest.raises(ValueError, match="redis_url"):
        SystemConfig(transport="redis").worker("decode")
    with pytest.raises(ValidationError):
        SystemConfig(prefill={"num_replicas": 0}).worker("prefill")
    assert SystemConfig().kvstore_config() is None


def test_ucx_host_from_config_then_environment_then_loopback(monkeypatch):
    from pdserve.services.worker import UCX_HOST_ENV, WorkerConfig

    monkeypatch.delenv(UCX_HOST_ENV, raising=False)
    assert WorkerConfig().resolved_ucx_host() == "127.0.0.1"
    monkeypatch.setenv(UCX_HOST_ENV, "10.1.2.3")  # the chart sets the pod IP here
    assert WorkerConfig().resolved_ucx_host() == "10.1.2.3"
    assert WorkerConfig(ucx_host="192.168.0.9").resolved_ucx_host() == "192.168.0.9"
