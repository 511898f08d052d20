"""What the soak reads from and does to a live system on this host: replica processes (found by the
process title Ray gives them, `ray::ServeReplica:<app>:<deployment>`), their RSS, the router's
/metrics, and `kill -9` of one replica with the time until Serve has replaced it."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROLES = ("router", "prefill", "decode")
LEAK_SERIES = ("pdserve_kv_leases", "pdserve_kv_cache_usage_ratio")


def replica_pids(app: str, deployment: str) -> list[int]:
    """Live processes of `app`'s replicas of `deployment` (Ray sets the title, so no Ray API is needed)."""
    title = f"ray::ServeReplica:{app}:{deployment}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if (proc / "cmdline").read_bytes().startswith(title):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return sorted(pids)


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a live process; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def snapshot_rss(app: str) -> dict[int, dict[str, Any]]:
    """{pid: {role, rss_bytes}} for every replica of every role now."""
    found = {}
    for role in ROLES:
        for pid in replica_pids(app, role):
            if (rss := rss_bytes(pid)) is not None:
                found[pid] = {"role": role, "rss_bytes": rss}
    return found


def scrape(client: httpx.Client, url: str) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    resp = client.get(f"{url}/metrics")
    resp.raise_for_status()
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(resp.text)
            for s in family.samples]


def counter_total(samples: list[tuple[str, dict[str, str], float]], name: str, by: str) -> dict[str, float]:
    """{label value: sum} of counter `name` (the `_total` sample) grouped by the label `by`."""
    totals: dict[str, float] = {}
    for sample, labels, value in samples:
        if sample == f"{name}_total":
            key = labels.get(by, "")
            totals[key] = totals.get(key, 0.0) + value
    return totals


def leak_series(samples: list[tuple[str, dict[str, str], float]]) -> list[dict[str, Any]]:
    """Every KV lease and KV usage series, per replica (and lease state)."""
    return [{"name": name, "role": labels.get("role"), "replica": labels.get("replica"),
             "state": labels.get("state"), "value": value}
            for name, labels, value in samples if name in LEAK_SERIES]


def wait_quiescent(url: str, num_workers: int, bound_s: float, ready_bound_s: float = 120.0,
                   ) -> tuple[list[dict[str, Any]], float | None]:
    """Waits (up to `ready_bound_s`) until /metrics shows exactly `num_workers` prefill and decode replicas
    (replacements up, dead ones gone), then up to `bound_s` until every KV lease and usage series reads 0.
    Returns the last series read and the seconds the second wait took (None: not within its bound)."""
    started = ready = time.monotonic()
    series: list[dict[str, Any]] = []
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            try:
                series = leak_series(scrape(client, url))
            except httpx.HTTPError:
                series = []
            if len(worker_replicas(series)) != num_workers:
                ready = time.monotonic()
                if ready - started > ready_bound_s:
                    return series, None
            elif not any(s["value"] for s in series):
                return series, time.monotonic() - ready
            elif time.monotonic() - ready > bound_s:
                return series, None
            time.sleep(0.1)


def worker_replicas(series: list[dict[str, Any]]) -> set[tuple[str, str]]:
    return {(s["role"], s["replica"]) for s in series if s["role"] in ("prefill", "decode")}


async def sample_rss(app: str, t0: float, every_s: float, into: list[dict[str, Any]]) -> None:
    """Every `every_s` until cancelled: {"t_s", "rss": {pid: bytes}} of every replica."""
    while True:
        into.append({"t_s": round(time.monotonic() - t0, 1),
                     "rss": {pid: v["rss_bytes"] for pid, v in snapshot_rss(app).items()}})
        await asyncio.sleep(every_s)


@dataclass
class Kill:
    role: str
    at_s: float  # seconds into the soak it is due
    pid: int | None = None
    killed_s: float | None = None
    replaced_s: float | None = None  # when a replacement replica process first showed up
    new_pid: int | None = None
    replacement_rss_bytes: int | None = None  # at first sight

    def window(self, grace_s: float, end_s: float) -> tuple[float, float] | None:
        """Seconds into the soak in which a failure may be blamed on this kill."""
        if self.killed_s is None:
            return None
        return self.killed_s, (self.replaced_s if self.replaced_s is not None else end_s) + grace_s

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


async def run_kill(kill: Kill, app: str, t0: float, rng: random.Random, replace_bound_s: float,
                   log: Callable[[str], None]) -> None:
    """At `kill.at_s`, SIGKILL one live replica of `kill.role`, then wait (bounded) for Serve to start another."""
    await asyncio.sleep(max(0.0, t0 + kill.at_s - time.monotonic()))
    before = replica_pids(app, kill.role)
    if not before:
        log(f"[soak] no live {kill.role} replica to kill")
        return
    kill.pid = rng.choice(before)
    os.kill(kill.pid, signal.SIGKILL)
    kill.killed_s = time.monotonic() - t0
    log(f"[soak] t={kill.killed_s:.1f}s kill -9 {kill.role} replica pid {kill.pid}")
    while time.monotonic() - t0 - kill.killed_s < replace_bound_s:
        fresh = [p for p in replica_pids(app, kill.role) if p not in before]
        if fresh:
            kill.new_pid, kill.replaced_s = fresh[0], time.monotonic() - t0
            kill.replacement_rss_bytes = rss_bytes(fresh[0])
            log(f"[soak] t={kill.replaced_s:.1f}s {kill.role} replaced by pid {kill.new_pid}")
            return
        await asyncio.sleep(0.25)
    log(f"[soak] {kill.role} not replaced within {replace_bound_s:.0f} s")
