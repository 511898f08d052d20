"""The router's pure parts: config keys and its torch-free import (placement: tests/unit/placement/)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pdserve.services.router import RouterConfig
from pydantic import ValidationError


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


def test_api_keys_from_file(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nsk-one\n\n  sk-two  \n")
    assert RouterConfig(api_keys=("sk-zero",), api_keys_file=str(keys)).resolved_api_keys() == (
        "sk-zero", "sk-one", "sk-two")
    other = tmp_path / "other"
    other.write_text("sk-env\n")
    monkeypatch.setenv("PDSERVE_API_KEYS_FILE", str(other))
    assert RouterConfig().resolved_api_keys() == ("sk-env",)
    with pytest.raises(FileNotFoundError):
        RouterConfig(api_keys_file=str(tmp_path / "missing")).resolved_api_keys()


def test_router_app_imports_no_torch():
    code = "import sys, pdserve.services.router.app; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
