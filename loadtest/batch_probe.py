"""The batch probe: the serving layer's time per decode step, measured on an otherwise idle target.

One request alone (the idle probe) is a poor witness of what serving adds to a step under load. On the 2-core
VMs the scenarios run on, a request that decodes alone streams more slowly than one that shares its steps
(its process and the relay hop between cores that have gone idle), and three such requests moved ±25%
between runs. The batch probe sends `k` requests at once, short prompts and long outputs, so that nearly
every step decodes all `k`; the simulator sends the same `k` (pdserve.sim.scenario.batch_latency), and the
TPOT the live system adds beyond it is calibrated as a cost on every decode step (pdserve.sim.calibrate).
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np
from pdserve.loadtest.metrics import request_metrics
from pdserve.loadtest.runner import run_load
from pdserve.loadtest.workloads import RequestSpec, TokenSource

PROBE_SEED = 0xBA7C


@dataclass(frozen=True)
class BatchProbeSpec:
    """`k` concurrent requests of `prompt_len` prompt and `output_len` output tokens, `rounds` times after one
    discarded warm-up round; k = 0 turns the probe off."""

    k: int = 8
    prompt_len: int = 64
    output_len: int = 128
    rounds: int = 2

    def __post_init__(self) -> None:
        if self.k < 0 or self.prompt_len < 1 or self.output_len < 2 or self.rounds < 1:
            raise ValueError("a batch probe needs k >= 0, prompt_len >= 1, output_len >= 2 and rounds >= 1")

    def requests(self, tokens: TokenSource, round_index: int) -> list[RequestSpec]:
        """Fresh prompts each round (no prefix-cache hit on an earlier round)."""
        rng = np.random.default_rng([PROBE_SEED, round_index])
        return [RequestSpec(tokens.random_ids(rng, self.prompt_len), self.output_len) for _ in range(self.k)]


@dataclass(frozen=True)
class BatchProbe:
    spec: BatchProbeSpec
    tpot_s: float  # median over the measured rounds' requests
    round_tpot_s: tuple[float, ...]  # each measured round's median

    def to_dict(self) -> dict[str, Any]:
        return {"k": self.spec.k, "prompt_len": self.spec.prompt_len, "output_len": self.spec.output_len,
                "rounds": self.spec.rounds, "tpot_ms": self.tpot_s * 1e3,
                "round_tpot_ms": [t * 1e3 for t in self.round_tpot_s]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BatchProbe:
        spec = BatchProbeSpec(int(d["k"]), int(d["prompt_len"]), int(d["output_len"]), int(d.get("rounds", 1)))
        return cls(spec, float(d["tpot_ms"]) / 1e3, tuple(float(t) / 1e3 for t in d.get("round_tpot_ms", ())))


def measure_batch(base_url: str, model: str, tokens: TokenSource, spec: BatchProbeSpec,
                  timeout_s: float = 120.0) -> BatchProbe:
    """The probe's rounds against a live target; every request must complete."""
    if spec.k == 0:
        raise ValueError("the batch probe is off (k = 0)")
    rounds: list[list[float]] = []
    for i in range(spec.rounds + 1):
        results, _ = asyncio.run(run_load(base_url, model, spec.requests(tokens, i), timeout_s, concurrency=spec.k))
        measured = [request_metrics(r) for r in results]
        if any(m is None or m.tpot_s is None for m in measured):
            errors = "; ".join(r.error for r in results if not r.ok) or "a request without two tokens"
            raise RuntimeError(f"batch probe failed at {base_url}: {errors}")
        if i > 0:  # round 0 warms the batch shapes up
            rounds.append([m.tpot_s for m in measured])  # type: ignore[union-attr,misc]
    every = [t for r in rounds for t in r]
    return BatchProbe(spec, statistics.median(every), tuple(statistics.median(r) for r in rounds))
