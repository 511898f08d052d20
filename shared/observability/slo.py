"""SLO attainment over a sliding time window: the share of recent requests that met TTFT/TPOT targets."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


def time_per_output_token(ttft_s: float | None, e2e_s: float | None, output_tokens: int) -> float | None:
    """Mean gap between output tokens after the first: (e2e - ttft) / (n - 1); None below two tokens."""
    if ttft_s is None or e2e_s is None or output_tokens < 2:
        return None
    return max(e2e_s - ttft_s, 0.0) / (output_tokens - 1)


@dataclass(frozen=True)
class SloAttainment:
    requests: int
    # Fractions in [0, 1]; None when the window holds no requests.
    ttft: float | None
    tpot: float | None
    both: float | None


class SloWindow:
    """Per-request outcomes with timestamps; attainment over those newer than `window_s`.

    A request meets the TTFT target when it produced a first token within `ttft_slo_s`, and the TPOT
    target when its TPOT is within `tpot_slo_s`, or it has no TPOT (one output token). A request that
    failed or produced no token misses both. Thread-safe; `clock` must not go backwards.
    """

    def __init__(
        self,
        window_s: float,
        ttft_slo_s: float,
        tpot_slo_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or ttft_slo_s <= 0 or tpot_slo_s <= 0:
            raise ValueError("window_s, ttft_slo_s and tpot_slo_s must be positive")
        self.window_s = window_s
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self._clock = clock
        self._lock = threading.Lock()
        self._samples: deque[tuple[float, bool, bool]] = deque()
        # Running totals over _samples: [ttft met, tpot met, both met]
        self._met = [0, 0, 0]

    def record(self, ttft_s: float | None, tpot_s: float | None = None, ok: bool = True) -> None:
        produced = ok and ttft_s is not None
        ttft_met = produced and ttft_s <= self.ttft_slo_s
        tpot_met = produced and (tpot_s is None or tpot_s <= self.tpot_slo_s)
        with self._lock:
            now = self._clock()
            self._expire(now)
            self._samples.append((now, ttft_met, tpot_met))
            self._count((ttft_met, tpot_met), +1)

    def record_failure(self) -> None:
        """A request rejected or failed before its first token: a miss on every target."""
        self.record(None, None, ok=False)

    def attainment(self) -> SloAttainment:
        with self._lock:
            self._expire(self._clock())
            n = len(self._samples)
            if n == 0:
                return SloAttainment(0, None, None, None)
            ttft, tpot, both = self._met
            return SloAttainment(n, ttft / n, tpot / n, both / n)

    def _count(self, met: tuple[bool, bool], sign: int) -> None:
        ttft_met, tpot_met = met
        self._met[0] += sign * ttft_met
        self._met[1] += sign * tpot_met
        self._met[2] += sign * (ttft_met and tpot_met)

    def _expire(self, now: float) -> None:
        # A sample recorded at t counts while now - t < window_s.
        horizon = now - self.window_s
        while self._samples and self._samples[0][0] <= horizon:
            _, ttft_met, tpot_met = self._samples.popleft()
            self._count((ttft_met, tpot_met), -1)
