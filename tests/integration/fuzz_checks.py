"""What the fuzz tests (test_fuzz_http.py, test_fuzz_grpc.py) check on every error and after every run:
no internals in a client-facing message, and nothing left running on the router or the workers."""

from __future__ import annotations

import re
import time

import httpx

# what a client must never read: tracebacks, source lines, Ray ids and names, pids, addresses, Python reprs
INTERNALS = re.compile(
    r"Traceback|File \"|line \d+, in |pid=|ActorID|actor_id|ray::|ServeReplica|RayActorError|RayTaskError"
    r"|\b\d{1,3}(?:\.\d{1,3}){3}\b|<[\w.]+ object at 0x|\b\w+(?:Error|Exception)\(|Value error, ")
WORKER_KEYS = ("num_free_blocks", "num_total_blocks", "num_leased_blocks", "num_running", "num_waiting")


def strings(value) -> list[str]:
    """Every string a request carries (keys included): error messages may quote them back."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*strings(k), *strings(v))]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in strings(v)]
    return []


def leaked_internals(message: str, sent) -> list[str]:
    """Internals in `message`, once whatever the client itself sent (`sent`) is taken out of it."""
    for quoted in sorted(strings(sent), key=len, reverse=True):
        if len(quoted) >= 3:
            message = message.replace(quoted, "")
    return INTERNALS.findall(message)


def router_inflight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    (value,) = [float(line.split()[-1]) for line in text.splitlines()
                if line.startswith("pdserve_router_inflight_requests ")]
    return value


def worker_stats(ray_serve, app: str) -> dict[str, dict]:
    return {name: {k: s[k] for k in WORKER_KEYS} for name in ("prefill", "decode")
            for s in [ray_serve.get_deployment_handle(name, app_name=app).stats.remote().result()]}


def _idle(stats: dict) -> bool:
    return stats["num_free_blocks"] == stats["num_total_blocks"] and not (
        stats["num_leased_blocks"] or stats["num_running"] or stats["num_waiting"])


def assert_idle(url: str, ray_serve, app: str, timeout_s: float = 15.0) -> dict:
    """No request in flight at the router, no sequence, block or lease held by a worker (within `timeout_s`,
    well under the lease TTL). Returns what it saw last."""
    deadline = time.monotonic() + timeout_s
    while True:
        inflight, stats = router_inflight(url), worker_stats(ray_serve, app)
        if inflight == 0 and all(_idle(s) for s in stats.values()):
            return {"router_inflight": inflight, **stats}
        assert time.monotonic() < deadline, f"left behind: {inflight} in flight at the router, workers {stats}"
        time.sleep(0.2)
