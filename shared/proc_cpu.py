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
