"""Test tiers, assigned at collection (never by hand in a module); `make test-fast` runs `-m "not slow"`.

An item is `slow` when it
- requests a fixture that starts Ray/Serve or a server, or needs a tool only `make test` installs (`make
  ops-tools`: promtool) (SLOW_FIXTURES, directly or through another fixture),
- lives under a directory of such tests (SLOW_DIRS: integration/ is Ray Serve, Redis and UCX by design;
  correctness/ is parity with HF transformers, mostly on the real SmolLM2 model: ~1 min),
- lives in a module that imports ucxx (UCX endpoints) or starts its own Redis (SLOW_IMPORTS), or
- is listed in SLOW_TESTS (runs a CLI that starts its own Ray, or takes several seconds).

Every other item runs under a tripwire: `ray.init`, starting UCX, or spawning a Redis/Valkey server or a
Ray process (gcs_server, raylet, `ray start`) fails it at once, so a test that starts them without landing
in the slow tier is caught the first time it runs.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

SLOW_FIXTURES = {
    "ray_serve", "replica_pids",  # one Ray + Serve per session (integration/conftest.py)
    "redis_server", "redis_server_factory",  # redis-server / valkey-server processes
    "otlp_receiver",  # OTLP gRPC + HTTP receiver (tracing/conftest.py)
    "promtool",  # Debian's prometheus package, from `make ops-tools`, which `make test-fast` does not run
}
SLOW_DIRS = {"integration", "correctness"}
SLOW_IMPORTS = {"ucxx", "RedisServer", "RedisSupervisor"}  # names in a module's globals
SLOW_TESTS = {  # node id prefix under tests/ -> why: what no rule above sees, or what ran > 5 s on 2 cores
    "loadtest/test_soak.py::test_a_small_soak_as_users_run_it": "runs `pdserve-loadtest soak`: its own Ray",
    "unit/kernels/test_engine_backends.py::test_tiny_greedy_matches_between_backends": "6-9 s",
    "unit/sim/test_committed_validation.py::test_the_committed_validation_is_what_validate_gives":
        "validates six scenarios' committed live reports: ~2 min",
    "unit/kvcache/test_kv_shm.py::test_importer_killed_mid_transfer_leaves_the_exporter_serving_and_the_lease_retryable":
        "two importer processes, 4096 pieces: 5-7 s",
    "unit/kvcache/test_kv_shm.py::test_exporter_killed_mid_transfer_fails_the_pull_cleanly_and_leaves_nothing_mapped":
        "two exporter processes, 4096 pieces: ~5 s",
}

SERVER_BINARIES = {"redis-server", "valkey-server", "gcs_server", "raylet"}


def slow_reason(item: pytest.Item) -> str | None:
    """Why `item` belongs in the slow tier, or None for the fast tier."""
    if found := SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return f"uses fixture {sorted(found)[0]}"
    path = item.path.relative_to(TESTS) if item.path.is_relative_to(TESTS) else item.path
    if path.parts[0] in SLOW_DIRS:
        return f"under tests/{path.parts[0]}/"
    module = getattr(item, "module", None)
    if module is not None and (found := SLOW_IMPORTS.intersection(vars(module))):
        return f"module imports {sorted(found)[0]}"
    nodeid = item.nodeid.removeprefix("tests/")
    return next((why for prefix, why in SLOW_TESTS.items() if nodeid.startswith(prefix)), None)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not item.get_closest_marker("slow") and (why := slow_reason(item)):
            item.add_marker(pytest.mark.slow(reason=why))


class TierError(pytest.fail.Exception):
    """A BaseException, like pytest.fail's: code that catches Exception (Ray's, Redis's) lets it through."""


def _refuse(what: str) -> None:
    raise TierError(
        f"{what} in a test of the fast tier: use the ray_serve / redis_server fixtures or move the test "
        f"under tests/integration/ (tests/conftest.py marks those slow), or add it to SLOW_TESTS there"
    )


def _is_server_command(args) -> bool:
    if isinstance(args, (str, bytes, os.PathLike)):
        args = shlex.split(os.fsdecode(args))
    argv = [os.fsdecode(a) for a in args]
    name = Path(argv[0]).name if argv else ""
    return name in SERVER_BINARIES or (name == "ray" and argv[1:2] == ["start"])


@pytest.fixture(autouse=True)
def _fast_tier_tripwire(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("slow"):
        return
    execute_child = subprocess.Popen._execute_child

    def guarded_execute_child(self, args, *rest, **kwargs):
        if _is_server_command(args):
            _refuse(f"starting a server process ({args!r})")
        return execute_child(self, args, *rest, **kwargs)

    # every spawn goes through here: subprocess.run, asyncio subprocesses, Ray's Popen subclass
    monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded_execute_child)
    # Only modules already imported are patched (importing Ray or torch here would slow every test);
    # a Ray started later still spawns gcs_server through Popen and trips the guard above.
    if "ray" in sys.modules:
        monkeypatch.setattr(sys.modules["ray"], "init", lambda *a, **k: _refuse("ray.init"))
    if (ucx_env := sys.modules.get("pdserve.kvcache.transports.ucx_env")) is not None:
        monkeypatch.setattr(ucx_env.ucx_context, "acquire", lambda user: _refuse("starting UCX"))


@pytest.fixture
def tier_rules():
    """This module (SLOW_FIXTURES, slow_reason, ...), for tests/test_tiers.py."""
    return sys.modules[__name__]
