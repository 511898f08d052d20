"""`otlp_receiver`: a real OTLP trace receiver (gRPC and HTTP) on free loopback ports, one per test."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

_RECEIVER_FILE = Path(__file__).resolve().parents[1] / "integration" / "otlp_receiver.py"
_MODULE_NAME = "pdserve_tests_otlp_receiver"


def load_receiver_module() -> ModuleType:
    """tests/ is not a package (pytest runs with --import-mode=importlib), so load the helper by path."""
    if (module := sys.modules.get(_MODULE_NAME)) is not None:
        return module
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, _RECEIVER_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def otlp_receiver() -> Iterator:
    receiver = load_receiver_module().OtlpReceiver().start()
    try:
        yield receiver
    finally:
        receiver.stop()
