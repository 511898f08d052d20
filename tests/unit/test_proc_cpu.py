"""ReplicaCPU reads real processes' CPU time per deployment: a busy replica counts, a sleeping one barely
does, one of another app or deployment goes elsewhere, and one that dies or starts in between is left out."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from pdserve.proc_cpu import PROC, HostCPU, ReplicaCPU, cpu_seconds, host_busy_seconds, serve_replica_pids

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
        dying.wait(60)  # 0.6 s of its own clock, after its interpreter starts beside three busy loops on 2 cores
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


def test_host_cpu_counts_a_busy_child_on_the_host_and_this_process_as_the_client():
    """A child spinning for 1.5 s shows in the host's busy seconds (at least most of a core), not in this
    process's; this process spinning 0.5 s shows in both."""
    meter = HostCPU()
    meter.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; t = time.monotonic()\n"
                              "while time.monotonic() - t < 1.5: pass"])
    child.wait(30)
    t = time.process_time()
    while time.process_time() - t < 0.5:
        pass
    out = meter.stop()
    assert 0.4 <= out["client"] < 1.2
    assert out["host"] >= 1.5 + 0.4 - 0.3  # the child's 1.5 s and ours 0.5 s, less a tick's slack each
    assert host_busy_seconds() > 0
