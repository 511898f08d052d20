"""bench_idle reads real processes' CPU time: a busy child counts, a sleeping one barely does, and an app
with no replica gives nothing."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.bench import idle as bench_idle

pytestmark = pytest.mark.skipif(not bench_idle.PROC.is_dir(), reason="needs /proc")


def _child(code: str, app: str, method: str = "") -> subprocess.Popen:
    """A Python process whose argv[0] is the name Ray gives a replica process of `app`'s decode deployment."""
    return subprocess.Popen([f"ray::ServeReplica:{app}:decode{method}", "-c", code], executable=sys.executable)


def test_busy_and_idle_replicas_are_told_apart():
    busy = _child("while True: pass", "busyapp")
    idle = _child("import time; time.sleep(60)", "idleapp")
    calling = _child("import time; time.sleep(60)", "idleapp", ".check_health")  # Ray's title mid-call
    try:
        time.sleep(0.3)
        assert bench_idle.idle_cpu_pct("busyapp", 1.0)["decode"] > 50
        assert bench_idle.idle_cpu_pct("idleapp", 1.0) == {"decode": pytest.approx(0, abs=5)}  # both, as one
        assert bench_idle.idle_cpu_pct("noapp", 0.1) == {}
    finally:
        for p in (busy, idle, calling):
            p.kill()
            p.wait()
