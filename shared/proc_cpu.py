"""CPU time of a Serve app's replica processes, read from /proc (Linux): what each deployment burned over
an interval, whether idle (pdserve bench idle) or under a load point (pdserve-loadtest)."""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def serve_replica_pids(app: str) -> dict[int, str]:
    """pid -> deployment, for the app's replica processes (Ray names them `ray::ServeReplica:{app}:{dep}`);
    {} where /proc is absent."""
    if not PROC.is_dir():
        return {}
    tag = f"ServeReplica:{app}:"
    out = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        if tag in cmdline:  # while it runs a method Ray retitles it `...:{dep}.{method}`
            out[int(entry.name)] = cmdline.split(tag, 1)[1].split()[0].split(".")[0]
    return out


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of the process; None once it is gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ReplicaCPU:
    """CPU seconds per deployment between `start()` and `stop()`, over the replicas alive at both (one that
    died or started in between is left out)."""

    def __init__(self, app: str) -> None:
        self.app = app
        self._pids: dict[int, str] = {}
        self._before: dict[int, float] = {}

    def start(self) -> None:
        self._pids = serve_replica_pids(self.app)
        self._before = {pid: t for pid in self._pids if (t := cpu_seconds(pid)) is not None}

    def stop(self) -> dict[str, float]:
        """Deployment -> CPU seconds since `start()`, summed over its replicas."""
        out: dict[str, float] = {}
        for pid, before in self._before.items():
            after = cpu_seconds(pid)
            if after is not None:
                out[self._pids[pid]] = out.get(self._pids[pid], 0.0) + after - before
        return dict(sorted(out.items()))


def host_busy_seconds() -> float | None:
    """CPU seconds every core of the host has spent busy since boot (/proc/stat: all but idle and iowait);
    None where /proc is absent."""
    try:
        fields = (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class HostCPU:
    """What the whole host and this process (the load client, in pdserve-loadtest) burned between `start()`
    and `stop()`, in CPU seconds; beside ReplicaCPU it says what the replicas' hosts spent outside them."""

    def start(self) -> None:
        self._host, self._own = host_busy_seconds(), _own_seconds()

    def stop(self) -> dict[str, float]:
        host = host_busy_seconds()
        out = {"client": _own_seconds() - self._own}
        if host is not None and self._host is not None:
            out["host"] = host - self._host
        return out


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system
