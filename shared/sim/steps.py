"""A simulated replica's steps, counted as the live engine counts its own (pdserve.engine.step_clock): how many,
their wall time as the host's sharing stretched it, and their CPU; the same again for the steps that carried
prompt tokens."""

from __future__ import annotations

from dataclasses import dataclass, fields

@dataclass
class StepLedger:
    num_steps: int = 0
    step_s: float = 0.0
    step_cpu_s: float = 0.0
    num_prefill_steps: int = 0
    prefill_step_s: float = 0.0
    prefill_step_cpu_s: float = 0.0

    def add(self, wall_s: float, cpu_s: float, prefill: bool) -> None:
        self.num_steps += 1
        self.step_s += wall_s
        self.step_cpu_s += cpu_s
        if prefill:
            self.num_prefill_steps += 1
            self.prefill_step_s += wall_s
            self.prefill_step_cpu_s += cpu_s

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def summed(ledgers: list[tuple[str, StepLedger]]) -> dict[str, dict[str, float]]:
    """Role -> its replicas' ledgers, summed (both roles, at 0 where none)."""
    out = {role: dict.fromkeys(StepLedger().to_dict(), 0.0) for role in ("prefill", "decode")}
    for role, ledger in ledgers:
        for name, value in ledger.to_dict().items():
            out[role][name] += value
    return out
