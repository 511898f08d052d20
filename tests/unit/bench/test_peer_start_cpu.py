"""`pdserve bench peer`'s start-up accounting on real processes: a session's CPU time by process, a child that
exited and was waited for included in its parent's, and the floor that work sets on the machine's cores."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from pdserve.bench.peer_servers import process_cpu, process_label, session_processes, usable_cores

# a parent that runs one busy child to its end (waited for), then sleeps; its session is the "server"
PARENT = """
import subprocess, sys, time
subprocess.run([sys.executable, "-c", "x = 0\\nfor i in range(3 * 10**6): x += i"], check=True)
print("child done", flush=True)
time.sleep(60)
"""


@pytest.fixture
def session():
    proc = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "child done"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_waited_for_child_counts_in_its_parents_cpu(session):
    result = process_cpu(session_processes(session.pid))
    own = psutil.Process(session.pid).cpu_times()
    label = process_label(psutil.Process(session.pid))
    assert own.children_user + own.children_system > 0  # the child's loop, read from the parent after its wait
    assert result["by_process"] == {label: result["cpu_s"]}
    assert result["cpu_s"] >= round(own.children_user + own.children_system, 2)
    assert result["cores"] == len(os.sched_getaffinity(0))
    assert result["floor_s"] == pytest.approx(result["cpu_s"] / result["cores"], abs=0.01)


def test_gone_processes_are_skipped(session):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    handle = psutil.Process(gone.pid)
    gone.wait()
    time.sleep(0.1)
    result = process_cpu([handle, psutil.Process(session.pid)])
    assert list(result["by_process"]) == [process_label(psutil.Process(session.pid))]


def _label_of(argv: list[str], marker: str, cwd=None) -> str:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=cwd)
    try:
        assert proc.stdout.readline().strip() == marker
        return process_label(psutil.Process(proc.pid))
    finally:
        proc.kill()
        proc.wait()


def test_labels_name_what_a_process_runs(tmp_path):
    ready = "import time; print('up', flush=True); time.sleep(30)"
    # a Ray worker retitles itself `ray::Actor.method`: the actor, not the method it is in
    retitled = f"import ray._raylet as r; r.setproctitle('ray::ServeController.listen_for_change'); {ready}"
    assert _label_of([sys.executable, "-c", retitled], "up") == "ray::ServeController"
    script = tmp_path / "dashboard" / "agent.py"
    script.parent.mkdir()
    script.write_text(ready)
    assert _label_of([sys.executable, "-u", str(script), "--flag"], "up") == "dashboard/agent.py"
    program = subprocess.Popen(["sleep", "30"])  # Popen returns once the child has exec'd
    try:
        assert process_label(psutil.Process(program.pid)) == "sleep"
    finally:
        program.kill()
        program.wait()
    assert _label_of([sys.executable, "-c", ready], "up") == "python -c"  # not the program text
    (tmp_path / "waiter.py").write_text(ready)
    assert _label_of([sys.executable, "-u", "-m", "waiter", "--flag"], "up", cwd=tmp_path) == "python -m waiter"


def test_usable_cores_follow_the_affinity():
    """A server started on one core of several has one core's floor (taskset, as a cgroup cpuset would)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    code = "from pdserve.bench.peer_servers import usable_cores; print(usable_cores())"
    done = subprocess.run(["taskset", "-c", str(cores[0]), sys.executable, "-c", code], capture_output=True,
                          text=True, check=True)
    assert done.stdout.strip() == "1" and usable_cores() == len(cores)
