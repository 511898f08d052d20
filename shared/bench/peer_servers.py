"""The servers `pdserve bench peer` compares, each started and stopped as a user would, and the memory and
CPU time of their processes read from /proc (psutil)."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from pdserve.runtime.ports import FREE, TIME_WAIT_S, port_state

# llama.cpp's C++ server in-process: binds loopback, serves until SIGINT/SIGTERM
_LLAMA_CPP_LAUNCH = """
import signal, sys
import xllamacpp as xlc
gguf, port, threads, slots, ctx = sys.argv[1], *map(int, sys.argv[2:6])
p = xlc.CommonParams()
p.model.path = gguf
p.port = port
p.n_parallel = slots
p.n_ctx = ctx * slots
p.cpuparams.n_threads = threads
p.cpuparams_batch.n_threads = threads
p.n_threads_http = slots + 4  # every stream, and a /v1/models probe, gets a thread of its own
server = xlc.Server(p)
print("listening", server.listening_address, flush=True)
signal.sigwait([signal.SIGINT, signal.SIGTERM])
"""


class Server(ABC):
    model: str
    settings: dict[str, Any]

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile("w+", prefix="pdserve-peer-", suffix=".log")  # noqa: SIM115

    @abstractmethod
    def command(self) -> list[str]: ...

    def is_worker(self, proc: psutil.Process) -> bool:
        return proc.pid == self.proc.pid

    def __enter__(self) -> Server:
        # free of the previous server's processes and of its connections' TIME_WAIT too, before the clock
        # starts: `pdserve serve` waits that out itself (pdserve.runtime.ports), which is not start-up time
        deadline = time.monotonic() + TIME_WAIT_S + 10
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        while (state := port_state(host, int(port))) != FREE:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.url} is still {state}: stop what listens there first")
            time.sleep(0.5)
        # a session of its own: the whole tree is found by session id and stopped as a group
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        _signal_group(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        deadline = time.monotonic() + 30
        while self.processes() and time.monotonic() < deadline:
            time.sleep(0.5)
        self._log.close()

    def wait_ready(self, timeout: float = 300) -> None:
        """Until a one-token completion succeeds (llama.cpp answers /v1/models while it still loads)."""
        import httpx

        deadline = time.monotonic() + timeout
        body = {"model": self.model, "prompt": "Hi", "max_tokens": 1}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command()[0]} exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.post(f"{self.url}/v1/completions", json=body, timeout=30).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.url} did not answer within {timeout:.0f} s: {self.log_tail()}")

    def log_tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-2000:]

    def processes(self) -> list[psutil.Process]:
        """Every live process of the server's session (Ray's daemons included)."""
        return session_processes(self.proc.pid)


class PdserveServer(Server):
    """`pdserve serve` with its default flags (the port aside, when another is asked, and a quantization,
    when one is asked: then the figures are not those of the defaults, and the settings say so)."""

    def __init__(self, port: int, model: str, quantization: str | None = None, config: Path | None = None) -> None:
        super().__init__(port)
        self.model = model
        self.port = port
        self.quantization = quantization
        self.config = config
        self.settings = {"command": " ".join(["pdserve", "serve", *self._flags()])}

    def _flags(self) -> list[str]:
        port = [] if self.port == 8000 else ["--port", str(self.port)]
        config = ["--config", str(self.config)] if self.config else []
        return config + port + (["--quantization", self.quantization] if self.quantization else [])

    def command(self) -> list[str]:
        return [str(Path(sys.executable).with_name("pdserve")), "serve", *self._flags()]

    def is_worker(self, proc: psutil.Process) -> bool:
        name = " ".join(proc.cmdline())
        return "ServeReplica" in name and ("prefill" in name or "decode" in name)


class LlamaCppServer(Server):
    """llama.cpp's server from the xllamacpp wheel, in a scratch venv made on first use."""

    def __init__(self, venv: Path, requirement: str, gguf: Path, port: int, threads: int, slots: int) -> None:
        super().__init__(port)
        self.venv, self.requirement, self.gguf = venv, requirement, gguf
        self.model = gguf.name
        self.threads, self.slots = threads, slots
        self.settings = {"package": requirement, "threads": threads, "slots": slots, "ctx_per_slot": 1024}

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def __enter__(self) -> Server:
        ensure_peer_venv(self.venv, self.requirement)
        return super().__enter__()

    def command(self) -> list[str]:
        port = self.url.rsplit(":", 1)[1]
        return [str(self.python), "-c", _LLAMA_CPP_LAUNCH, str(self.gguf), port, str(self.threads), str(self.slots),
                str(self.settings["ctx_per_slot"])]


def ensure_peer_venv(venv: Path, requirement: str) -> None:
    """A scratch venv holding `requirement` (made once): the peer is a tool, never a project dependency."""
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import xllamacpp"], capture_output=True, check=False).returncode == 0:
        return
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", requirement], capture_output=True, text=True, check=False)
    if install.returncode != 0:
        raise RuntimeError(f"pip install {requirement} into {venv} failed: {install.stderr[-500:]}")


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # every process of the group has exited already
        pass


def session_processes(sid: int) -> list[psutil.Process]:
    """Every live (not zombie) process of session `sid`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def process_memory(processes: list[psutil.Process], is_worker: Callable[[psutil.Process], bool]) -> dict[str, Any]:
    """RSS and PSS (shared pages split among their users) in MB: summed over `processes`, and of the largest
    worker process."""
    total_rss = total_pss = 0.0
    workers: list[tuple[float, float, str]] = []
    for proc in processes:
        try:
            info = proc.memory_full_info()
            rss, pss = info.rss / 1e6, getattr(info, "pss", info.rss) / 1e6
            total_rss, total_pss = total_rss + rss, total_pss + pss
            if is_worker(proc):
                workers.append((rss, pss, " ".join(proc.cmdline())[:80]))
        except psutil.Error:
            continue
    if not workers:
        raise RuntimeError("no worker process found to measure")
    rss, pss, name = max(workers)
    return {"num_processes": len(processes), "total_rss_mb": round(total_rss, 1), "total_pss_mb": round(total_pss, 1),
            "largest_worker_rss_mb": round(rss, 1), "largest_worker_pss_mb": round(pss, 1), "largest_worker": name,
            "num_workers": len(workers)}


def process_label(proc: psutil.Process) -> str:
    """A process by what it runs: a Ray actor or replica by its name (`ray::ServeReplica:app:decode`), else the
    script or program (`pdserve`, `gcs_server`, `dashboard/agent.py`)."""
    argv = proc.cmdline()
    if not argv:
        return proc.name()
    if argv[0].startswith("ray::"):
        return argv[0].split(".", 1)[0]  # `ray::ServeController.listen_for_change`: the actor, not its method
    script = ""
    if "python" in Path(argv[0]).name:
        for flag, value in itertools.pairwise([*argv[1:], ""]):
            if flag in ("-c", "-m"):
                return f"python {flag}" if flag == "-c" else f"python -m {value}"
            if not flag.startswith("-"):
                script = flag
                break
    path = Path(script or argv[0])
    return f"{path.parent.name}/{path.name}" if path.suffix == ".py" else path.name


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which a cgroup's cpuset narrows), else every core."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def process_cpu(processes: list[psutil.Process]) -> dict[str, Any]:
    """CPU seconds (user + system) the processes used so far, with their children that have exited and been
    waited for (a one-shot check, a worker the raylet reaped), in all and by `process_label`; `floor_s` is that
    work spread over the cores it may run on: no start-up that does it can be shorter."""
    by_label: dict[str, float] = {}
    for proc in processes:
        try:
            times = proc.cpu_times()
            label = process_label(proc)
        except psutil.Error:
            continue
        seconds = times.user + times.system + times.children_user + times.children_system
        by_label[label] = by_label.get(label, 0.0) + seconds
    total = sum(by_label.values())
    cores = usable_cores()
    return {"cpu_s": round(total, 2), "cores": cores, "floor_s": round(total / cores, 2),
            "by_process": {k: round(v, 2) for k, v in sorted(by_label.items(), key=lambda kv: -kv[1])}}
