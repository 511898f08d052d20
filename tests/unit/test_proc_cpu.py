"""ReplicaCPU reads real processes' CPU time per deployment: a busy replica counts, a sleeping one barely
does, one of another app or deployment goes elsewhere, and one that dies or starts in between is left out."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.proc_cpu import PROC, ReplicaCPU, cpu_seconds, serve_replica_pids

pytestmark = pytest.mark.skipif(not PROC.is_dir(), reason="needs /proc")


def _child(code: str, app: str, deployment: str) -> subprocess.Popen:
    """A Python process whose argv[0] is the name Ray gives a replica process of `app`'s `deployment`."""
    return subprocess.Popen([f"ray::ServeReplica:{app}:{deployment}", "-c", code], executable=sys.executable)


def test_cpu_seconds_per_deployment_between_start_and_stop():
    busy = _child("while True: pass", "cpuapp", "decode")
    idle = _child("import time; time.sleep(60)", "cpuapp", "router")
    other = _child("while True: pass", "otherapp", "decode")
    dying = _child("import time; t = time.monotonic()\nwhile time.monotonic() - t < 0.6: pass", "cpuapp", "prefill")
    late = None
    try:
        time.sleep(0.3)
        assert set(serve_replica_pids("cpuapp").values()) == {"decode", "router", "prefill"}
        meter = ReplicaCPU("cpuapp")
        meter.start()
        busy_before = cpu_seconds(busy.pid)
        late = _child("while True: pass", "cpuapp", "decode")
        time.sleep(1.5)
        dying.wait(5)
        used = meter.stop()
        busy_used = cpu_seconds(busy.pid) - busy_before
        assert cpu_seconds(dying.pid) is None
        assert set(used) == {"decode", "router"}  # the dead prefill replica is left out
        assert busy_used > 0.1
        # the busy replica alone (to a clock tick either side): the late one is not counted
        assert used["decode"] == pytest.approx(busy_used, abs=0.05)
        assert used["router"] < busy_used / 2
    finally:
        for p in (busy, idle, other, dying, late):
            if p is not None:
                p.kill()
                p.wait()


def test_an_app_with_no_replica_gives_nothing():
    meter = ReplicaCPU("noapp")
    meter.start()
    assert meter.stop() == {}
