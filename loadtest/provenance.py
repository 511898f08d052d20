"""Where a report came from: the commit it ran, when, and on what machine."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True,
                             text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


# what the code that ran does, where a model of the run must know it (pdserve.loadtest.validation_model):
# engines count a request in their stats while it waits for a step in flight to end (commit 302a9c5)
STATS_COUNT_ARRIVING = "stats_count_arriving"
# the router hands a long prompt's KV to decode in parts while it is prefilled (kv_part_tokens, commit fcd3b0e);
# reports from before features were listed ran it from KV_PARTS_SINCE on
KV_PARTS = "kv_parts"
KV_PARTS_SINCE = "2026-11-26 22:21 UTC"
FEATURES = (STATS_COUNT_ARRIVING, KV_PARTS)


def provenance() -> dict[str, Any]:
    """The commit (with '+dirty' when the tree has uncommitted changes), the UTC date, the host, and the
    features of the code that ran."""
    commit = _git("rev-parse", "--short", "HEAD")
    if commit and _git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return {"commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "host": {"cpu": _cpu_model(), "cores": os.cpu_count(), "memory_gib": _memory_gib(),
                     "gpu": None}, "features": list(FEATURES)}


def header_line(p: dict[str, Any] | None) -> str:
    """'- ran: commit abc1234, 2026-11-25 10:00 UTC, on <cpu> (2 cores, 23.4 GiB)' for a report's header."""
    if not p:
        return "- ran: commit, date and machine not recorded"
    host = p.get("host") or {}
    memory = f", {host['memory_gib']:g} GiB" if host.get("memory_gib") else ""
    return (f"- ran: commit `{p.get('commit') or 'unknown'}`, {p.get('date') or 'date unknown'}, "
            f"on {host.get('cpu') or 'an unknown CPU'} ({host.get('cores') or '?'} cores{memory}, "
            f"{host.get('gpu') or 'no GPU'})")
