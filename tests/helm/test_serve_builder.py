"""pdserve.services.serve_builder: the `import_path` targets of the chart's serveConfigV2."""

from __future__ import annotations

import pytest
from ray.serve import Application

from pdserve.services.serve_builder import build_kvstore, build_pdserve, expand_env, system_config


def test_expand_env_quotes_for_a_url():
    url = "redis://:${PDSERVE_REDIS_PASSWORD}@redis:6379/0"
    assert expand_env(url, {"PDSERVE_REDIS_PASSWORD": "a/b@c:d"}) == "redis://:a%2Fb%40c%3Ad@redis:6379/0"


def test_expand_env_unset_variable_is_an_error():
    with pytest.raises(ValueError, match="PDSERVE_REDIS_PASSWORD"):
        expand_env("redis://:${PDSERVE_REDIS_PASSWORD}@redis:6379/0", {})


def test_only_pdserve_variables_are_expanded():
    assert expand_env("redis://${HOME}:${PDSERVE_X}@h/0", {"HOME": "/root", "PDSERVE_X": "y"}) == "redis://${HOME}:y@h/0"


def test_system_config_validates_args():
    with pytest.raises(ValueError):
        system_config({"mode": "both"})
    config = system_config({"redis_url": "redis://:${PDSERVE_P}@r/0", "prefill": {"num_cpus": 2}}, {"PDSERVE_P": "pw"})
    assert config.redis_url == "redis://:pw@r/0" and config.worker("prefill").num_cpus == 2


def test_builders_return_applications(monkeypatch):
    monkeypatch.setenv("PDSERVE_REDIS_PASSWORD", "pw")
    args = {"model": "tiny", "redis_url": "redis://:${PDSERVE_REDIS_PASSWORD}@127.0.0.1:6379/0",
            "decode": {"label_selector": {"pdserve.io/role": "decode"}}}
    assert isinstance(build_pdserve(args), Application)
    assert isinstance(build_kvstore(args), Application)
    with pytest.raises(ValueError, match="redis_url"):
        build_kvstore({"model": "tiny"})


@pytest.mark.parametrize("values, expected", [
    ("autoscaling-values.yaml", "redis"),  # 2 to 8 routers, the chart's own Redis: they share placements
    ("multi-router-values.yaml", "redis"),
    ("minimal-cpu-values.yaml", "none"),  # no Redis tier: nothing to share over (and one router)
])
def test_the_charts_multi_router_installs_share_placements(render, values, expected):
    """The router of each rendered serve config gets the system's Redis, so placement_sync (auto) is on."""
    import yaml

    from pdserve.placement.sync import create_sync
    from pdserve.services.router.config import RouterConfig
    from pdserve.services.serve_builder import system_config as build_config

    from pathlib import Path

    chart = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
    (rs,) = [d for d in render([chart / "ci" / values]) if d["kind"] == "RayService"]
    (app,) = [a for a in yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"] if a["name"] == "pdserve"]
    config = build_config(app["args"], {"PDSERVE_REDIS_PASSWORD": "pw"})
    router = RouterConfig.model_validate({**config.router, "redis_url": config.redis_url})
    assert create_sync(router.placement_sync, router.redis_url, "c", 0.002).name == expected
