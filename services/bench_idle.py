"""What a deployed app's replicas burn with no request in flight (the router's stats polls, the workers'
answers to them, transport threads): each Serve replica process's CPU time over a quiet interval, read
from /proc (Linux), as a percentage of one core."""

from __future__ import annotations

import os
import time
from pathlib import Path

PROC = Path("/proc")


def _replicas(app: str) -> dict[int, str]:
    """pid -> deployment, for the app's replica processes (Ray names them `ray::ServeReplica:{app}:{dep}`)."""
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


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def idle_cpu_pct(app: str, seconds: float = 5.0) -> dict[str, float]:
    """Deployment -> CPU % of one core over `seconds`, summed over its replicas; {} where /proc is absent."""
    if not PROC.is_dir():
        return {}
    replicas = _replicas(app)
    before = {pid: _cpu_seconds(pid) for pid in replicas}
    start = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    out: dict[str, float] = {}
    for pid, deployment in replicas.items():
        after = _cpu_seconds(pid)
        if after is not None and before[pid] is not None:
            out[deployment] = out.get(deployment, 0.0) + 100 * (after - before[pid]) / elapsed
    return {k: round(v, 2) for k, v in sorted(out.items())}
