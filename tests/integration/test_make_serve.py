"""`make serve` exactly as a user runs it: no flags, this machine's CPUs, the default model, port 8000.

Ctrl-C is what a terminal sends: SIGINT to the whole foreground process group (make, pdserve, and
every Ray process that stayed in it). Afterwards no process the command started may be alive.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PORT = 8000  # the default port: `make serve` passes no flags
MODEL = "smollm2-135m-instruct"

pytestmark = pytest.mark.skipif(not (ROOT / "Makefile").is_file(), reason="needs the source tree's Makefile")


def _port_taken(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _start_time(pid: int) -> str | None:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _descendants(root: int) -> dict[int, str]:
    """pid -> start time of `root` and every process below it, or in its session (re-parented ones too)."""
    tree, found, todo = _children(), {}, [root]
    while todo:
        pid = todo.pop()
        if (started := _start_time(pid)) is not None:
            found[pid] = started
            todo.extend(tree.get(pid, ()))
    for entry in Path("/proc").iterdir():  # start_new_session: the session id is make's pid
        if entry.name.isdigit() and _sid(int(entry.name)) == root:
            found.setdefault(int(entry.name), _start_time(int(entry.name)) or "")
    return found


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(processes: dict[int, str]) -> list[str]:
    left = []
    for pid, started in processes.items():
        if _start_time(pid) == started and started:
            cmd = _cmdline(pid)[:160]
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                left.append(f"{pid}: {cmd}")
    return left


class MakeServe:
    def __init__(self, log: Path) -> None:
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115
        # start_new_session: a process group of its own, like a shell job; the test's group is not signalled
        self.proc = subprocess.Popen(["make", "serve"], cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.seen: dict[int, str] = {}
        self.commands: set[str] = set()

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            self._track()
            assert self.proc.poll() is None, f"make serve exited early:\n{self.output[-4000:]}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout}s:\n{self.output[-4000:]}"
            time.sleep(0.5)
        self._track()

    def _track(self) -> None:
        found = _descendants(self.proc.pid)
        self.commands.update(_cmdline(pid) for pid in found.keys() - self.seen.keys())
        self.seen.update(found)

    def ctrl_c(self, timeout: float = 60) -> float:
        started = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            pytest.fail(f"one Ctrl-C did not stop make serve within {timeout}s:\n{self.output[-4000:]}")
        finally:
            self._log.close()
        return time.monotonic() - started

    def assert_nothing_left(self) -> None:
        assert any("raylet" in cmd for cmd in self.commands), "the check saw no Ray process: it would prove nothing"
        deadline = time.monotonic() + 15
        while (left := _alive(self.seen)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, "processes left behind:\n" + "\n".join(left)
        assert not _port_taken(PORT), f"port {PORT} still taken after Ctrl-C"
        # the terminal's SIGINT reaches the whole group: Redis must be stopped by pdserve, not killed and restarted
        assert "restarting it on port" not in self.output, self.output[-4000:]


@pytest.fixture
def make_serve(tmp_path):
    if _port_taken(PORT):
        pytest.fail(f"port {PORT} is taken by another program: `make serve` listens there", pytrace=False)
    runs: list[MakeServe] = []

    def start() -> MakeServe:
        runs.append(MakeServe(tmp_path / f"make-serve-{len(runs)}.log"))
        return runs[-1]

    yield start
    for run in runs:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()


def test_make_serve_answers_with_the_real_model_and_one_ctrl_c_stops_everything(make_serve):
    import httpx
    import openai

    run = make_serve()
    run.wait_for("pdserve is serving", timeout=600)
    assert "CPU split of the" in run.output
    assert httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=10).status_code == 200
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    run.ctrl_c()
    assert "shutting down" in run.output and "pdserve serve: stopped" in run.output
    run.assert_nothing_left()


def test_one_ctrl_c_during_start_up_stops_everything(make_serve):
    run = make_serve()
    run.wait_for("loading ", timeout=600)  # Ray is up and the replicas are being placed and loaded
    run.ctrl_c()
    assert "pdserve is serving" not in run.output
    assert "pdserve serve: stopped" in run.output
    run.assert_nothing_left()


def test_ctrl_c_then_make_serve_again_at_once_answers_three_times_in_a_row(make_serve):
    """Stopped and started again at once, as a user does: before, the new router could not bind port 8000
    (the old replica still listened, or its closed connections sat in TIME_WAIT) and Serve blocked it."""
    import openai

    for attempt in range(3):
        run = make_serve()
        run.wait_for("pdserve is serving", timeout=600)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=32, temperature=0)
        assert "Paris" in answer.choices[0].message.content, f"attempt {attempt}"
        run.ctrl_c()
        assert "pdserve serve: stopped" in run.output


def test_port_8000_held_by_another_program_exits_2_naming_it(tmp_path):
    """`pdserve serve` with no flags, as users run it, while another process listens on port 8000."""
    import sys

    if _port_taken(PORT):
        pytest.fail(f"port {PORT} is taken by another program: this test must hold it itself", pytrace=False)
    # a server stopped just before (another test) leaves TCP TIME_WAIT on the port for up to 60 s
    holder = (f"import socket, time\ns = socket.socket()\nfor _ in range(180):\n    try:\n"
              f"        s.bind(('127.0.0.1', {PORT}))\n        break\n    except OSError:\n        time.sleep(0.5)\n"
              "s.listen()\nprint('ready', flush=True)\ntime.sleep(120)\n")
    other = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "ready"
        started = time.monotonic()
        done = subprocess.run([str(ROOT / ".venv" / "bin" / "pdserve"), "serve"], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
        elapsed = time.monotonic() - started
    finally:
        other.kill()
        other.wait()
    print(f"exit {done.returncode} after {elapsed:.1f} s: {done.stderr.strip()}")
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"port {PORT} (--port) is in use by another program, pid {other.pid} (python" in done.stderr
