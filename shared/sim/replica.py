"""One simulated replica: its engine, its place in the cluster's lifecycle and handoffs, the step in flight,
and what its steps cost (pdserve.sim.cluster drives it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.sim.engine import Batch, Engine
from pdserve.sim.steps import StepLedger


@dataclass(eq=False)
class Replica:
    engine: Engine
    role: str  # "prefill" | "decode" (colocated engines report as decode, as the live ones do)
    requested_s: float
    ready_s: float
    stopped_s: float | None = None
    is_draining: bool = False
    num_inbound: int = 0  # handoffs on their way to it
    num_held: int = 0  # prefilled sequences whose blocks wait for their handoff
    batch: Batch | None = None
    step_start: float = 0.0
    step_version: int = 0  # a step-end event for an older version is stale (its end moved)
    cpu_s: float = 0.0  # CPU seconds its steps burned: profiled time x threads (sharing stretches wall time only)
    step_cpu: float = 0.0  # the step in flight's CPU seconds
    steps: StepLedger = field(default_factory=StepLedger)  # its steps, as the live engine counts them

    @property
    def replica_id(self) -> str:
        return self.engine.replica_id

    @property
    def is_empty(self) -> bool:
        return self.engine.is_idle and not self.num_inbound and not self.num_held
