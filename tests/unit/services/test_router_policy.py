"""The router's pure parts: the disaggregate decision table, config keys, and its torch-free import."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pdserve.services.router import Decision, RouterConfig, decide
from pydantic import ValidationError


@pytest.mark.parametrize("mode,num_tokens,has_prefill,logprobs,expected", [
    ("disaggregated", 100, True, False, Decision(True, "long_prompt")),
    ("disaggregated", 32, True, False, Decision(True, "long_prompt")),
    ("disaggregated", 31, True, False, Decision(False, "short_prompt")),
    ("disaggregated", 100, False, False, Decision(False, "no_prefill_pool")),
    ("disaggregated", 100, True, True, Decision(False, "logprobs")),
    ("colocated", 100, True, False, Decision(False, "colocated")),
])
def test_decision_table(mode, num_tokens, has_prefill, logprobs, expected):
    assert decide(mode, num_tokens, 32, has_prefill, logprobs) == expected


def test_config_is_frozen_strict_and_merges_env_keys(monkeypatch):
    with pytest.raises(ValidationError):
        RouterConfig(bogus=1)
    with pytest.raises(ValidationError):
        RouterConfig(mode="sideways")
    config = RouterConfig(api_keys=("a",))
    with pytest.raises(ValidationError):
        config.mode = "colocated"
    monkeypatch.setenv("PDSERVE_API_KEYS", "b, ,c,a")
    assert config.resolved_api_keys() == ("a", "b", "c")
    monkeypatch.delenv("PDSERVE_API_KEYS")
    assert RouterConfig().resolved_api_keys() == ()


def test_router_app_imports_no_torch():
    code = "import sys, pdserve.services.router.app; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
