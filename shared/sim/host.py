"""CPU beyond the engine steps, per generated token, on a host whose cores the replicas share.

A live replica spends CPU per generated token outside the step it times: detokenising, streaming the
token to the router, its event loop; the router, the Serve proxy and the load client spend more on the
same token. On an idle host that work overlaps the next step on a free core and adds nothing to latency;
once the cores are busy it takes capacity from every step. `OffStepLoad` keeps that work over a sliding
window and reports it in cores, which `Simulation._sharing` adds to the busy steps' threads.
"""

from __future__ import annotations

from collections import deque


class OffStepLoad:
    def __init__(self, cpu_per_token_s: float, window_s: float = 1.0) -> None:
        if cpu_per_token_s < 0 or not window_s > 0:
            raise ValueError("cpu_per_token_s must be >= 0 and window_s > 0")
        self.cpu_per_token_s, self.window_s = cpu_per_token_s, window_s
        self._spent: deque[tuple[float, float]] = deque()  # (when, CPU seconds), oldest first
        self._total = 0.0

    def add(self, now: float, tokens: int) -> float:
        """Records `tokens` generated at `now`; returns the CPU seconds they cost."""
        cpu = tokens * self.cpu_per_token_s
        if cpu > 0:
            self._spent.append((now, cpu))
            self._total += cpu
        return cpu

    def cores(self, now: float) -> float:
        """Cores kept busy by the off-step work of the last window."""
        while self._spent and self._spent[0][0] <= now - self.window_s:
            self._total -= self._spent.popleft()[1]
        return max(0.0, self._total) / self.window_s
