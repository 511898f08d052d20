"""The simulator's autoscaler: the replicas' stats and a sliding window of arrivals and finishes, fed
every `interval_s` to the pure policy (pdserve.autoscale.decide), as a Serve policy would feed it."""

from __future__ import annotations

from collections import deque
from typing import Any

from pdserve.autoscale import AutoscaleConfig, RoleStats, ScalingInputs, Traffic, decide
from pdserve.latency_model import LatencyProfile
from pdserve.sim.cluster import Simulation
from pdserve.sim.results import RequestRecord

MIN_OBSERVED = 20  # finished requests in the window before its attainment counts


class SloScaler:
    def __init__(self, sim: Simulation, profile: LatencyProfile, config: AutoscaleConfig,
                 interval_s: float = 10.0) -> None:
        self.profile, self.config, self.interval_s = profile, config, interval_s
        self.state: dict[str, dict[str, Any]] = {}
        self.arrivals: deque[tuple[float, int, int]] = deque()  # (time, prompt, output)
        self.finishes: deque[tuple[float, bool, bool]] = deque()  # (time, TTFT met, TPOT met)
        self.history: list[dict[str, Any]] = []
        sim.observers.on_arrival.append(self._arrived)
        sim.observers.on_finish.append(self._finished)
        sim.scaler = self

    def _arrived(self, record: RequestRecord, now: float) -> None:
        self.arrivals.append((now, record.request.prompt_tokens, record.request.output_tokens))

    def _finished(self, record: RequestRecord, now: float) -> None:
        ttft, tpot = record.ttft_s, record.tpot_s
        ttft_ok = record.status == "ok" and ttft is not None and ttft <= self.config.ttft_slo_s
        tpot_ok = record.status == "ok" and (tpot is None or tpot <= self.config.tpot_slo_s)
        self.finishes.append((now, ttft_ok, tpot_ok))

    def inputs(self, sim: Simulation, now: float) -> ScalingInputs:
        horizon = now - self.config.window_s
        while self.arrivals and self.arrivals[0][0] < horizon:
            self.arrivals.popleft()
        while self.finishes and self.finishes[0][0] < horizon:
            self.finishes.popleft()
        n = len(self.arrivals)
        span = min(self.config.window_s, now) or 1.0
        mean_prompt = sum(a[1] for a in self.arrivals) / n if n else 0.0
        cv2 = None
        if n > 1 and mean_prompt > 0:
            cv2 = sum((a[1] - mean_prompt) ** 2 for a in self.arrivals) / (n - 1) / mean_prompt**2
        traffic = Traffic(n / span, mean_prompt, sum(a[2] for a in self.arrivals) / n if n else 0.0, cv2)
        done = len(self.finishes)
        ttft = sum(f[1] for f in self.finishes) / done if done >= MIN_OBSERVED else None
        tpot = sum(f[2] for f in self.finishes) / done if done >= MIN_OBSERVED else None
        return ScalingInputs(now, traffic, self._role(sim, "prefill", ttft, None),
                             self._role(sim, "decode", None, tpot))

    def _role(self, sim: Simulation, role: str, ttft: float | None, tpot: float | None) -> RoleStats:
        replicas = sim.active(role)
        spec = sim.spec.prefill if role == "prefill" else sim.spec.decode
        engines = [r.engine for r in replicas]
        return RoleStats(
            num_replicas=len(replicas), queued_prompt_tokens=sum(e.queued_prefill_tokens() for e in engines),
            num_running=sum(len(e.running) for e in engines),
            num_used_blocks=sum(spec.num_blocks - e.num_free_blocks for e in engines),
            num_total_blocks=spec.num_blocks * len(engines), block_size=spec.block_size,
            max_num_seqs=spec.max_num_seqs, max_num_batched_tokens=spec.max_num_batched_tokens,
            ttft_attainment=ttft, tpot_attainment=tpot)

    def desired(self, sim: Simulation, now: float) -> dict[str, int]:
        inputs = self.inputs(sim, now)
        decision = decide(inputs, self.profile, self.config, self.state, sim.spec.transport)
        self.state = decision.state
        self.history.append({"t": now, "rate": inputs.traffic.arrival_rate_rps,
                             "prompt": inputs.traffic.mean_prompt_tokens, "output": inputs.traffic.mean_output_tokens,
                             **{f"{r}_{k}": getattr(getattr(decision, r), k) for r in ("prefill", "decode")
                                for k in ("current", "desired", "needed")}})
        return decision.replicas()
