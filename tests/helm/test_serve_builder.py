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
