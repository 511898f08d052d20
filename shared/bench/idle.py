"""What a deployed app's replicas burn with no request in flight (the router's stats polls, the workers'
answers to them, transport threads): each Serve replica process's CPU time over a quiet interval, read
from /proc (Linux), as a percentage of one core."""

from __future__ import annotations

import time

from pdserve.proc_cpu import PROC, ReplicaCPU


def idle_cpu_pct(app: str, seconds: float = 5.0) -> dict[str, float]:
    """Deployment -> CPU % of one core over `seconds`, summed over its replicas; {} where /proc is absent."""
    if not PROC.is_dir():
        return {}
    meter = ReplicaCPU(app)
    meter.start()
    start = time.monotonic()
    time.sleep(seconds)
    elapsed = time.monotonic() - start
    return {k: round(100 * v / elapsed, 2) for k, v in meter.stop().items()}
