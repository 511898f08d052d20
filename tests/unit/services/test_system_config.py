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


def test_placement_sync_over_redis_needs_the_systems_redis():
    from pdserve.services.app import config_errors

    with pytest.raises(ValidationError) as err:
        SystemConfig(router={"placement_sync": "redis"})
    assert config_errors(err.value) == [
        "router.placement_sync: redis needs the system's redis_url (or auto / none)"]
    with pytest.raises(ValidationError) as err:
        SystemConfig(router={"placement_sync": "gossip"})
    assert config_errors(err.value)[0].startswith("router.placement_sync: Input should be 'auto', 'none' or 'redis'")
    with pytest.raises(ValidationError) as err:
        SystemConfig(router={"placement_sync_flush_ms": 0})
    assert config_errors(err.value)[0].startswith("router.placement_sync_flush_ms:")
    assert SystemConfig(redis_url="redis://127.0.0.1:6379/0", router={"placement_sync": "redis"})


def test_a_router_queue_that_cannot_fill_is_refused_naming_the_field():
    from pdserve.services.app import config_errors

    for router, expected in [
        ({"queue_max_requests": 8, "placement": {"admission": "queue"}}, "queue_max_requests: placement.admission"),
        ({"queue_max_requests": 256}, "queue_max_requests (256) must be below max_inflight (256)"),
        ({"queue_max_requests": -1}, "router.queue_max_requests:"),
        ({"queue_timeout_s": 0}, "router.queue_timeout_s:"),
    ]:
        with pytest.raises(ValidationError) as err:
            SystemConfig(router=router)
        assert expected in config_errors(err.value)[0], config_errors(err.value)
    assert SystemConfig(router={"queue_max_requests": 32, "queue_timeout_s": 1.5})
