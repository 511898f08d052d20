"""The serving probe: what the serving path adds to a request's TTFT, measured on an otherwise idle target.

The idle probe sends prompts of the workload's mean length (1,520 tokens on prefix-routing), so its TTFT is
mostly prefill; what HTTP, the Serve proxy, the router, placement and the first SSE event add is the small
difference between that TTFT and the simulator's scaled prefill, and a machine check a few percent off (the
2-core VMs drift by that within minutes) moves it by more than its size. The serving probe sends prompts so
short that their prefill is a few milliseconds, one at a time after a discarded warm-up: its TTFT is the
serving path's, give or take a prefill the profile times well (pdserve.sim.calibrate).
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

PROBE_SEED = 0x5E7E


@dataclass(frozen=True)
class ServingProbeSpec:
    """`requests` sequential requests of `prompt_len` prompt and `output_len` output tokens, after one discarded
    warm-up request; requests = 0 turns the probe off."""

    requests: int = 5
    prompt_len: int = 16
    output_len: int = 2

    def __post_init__(self) -> None:
        if self.requests < 0 or self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("a serving probe needs requests >= 0, prompt_len >= 1 and output_len >= 1")

    def specs(self, tokens: TokenSource) -> list[RequestSpec]:
        """The warm-up and the measured requests, each a fresh prompt (no prefix-cache hit)."""
        rng = np.random.default_rng(PROBE_SEED)
        return [RequestSpec(tokens.random_ids(rng, self.prompt_len), self.output_len)
                for _ in range(self.requests + 1)]


@dataclass(frozen=True)
class ServingProbe:
    spec: ServingProbeSpec
    ttft_s: float  # median over the measured requests
    each_ttft_s: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.spec.requests, "prompt_len": self.spec.prompt_len,
                "output_len": self.spec.output_len, "ttft_ms": self.ttft_s * 1e3,
                "each_ttft_ms": [t * 1e3 for t in self.each_ttft_s]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServingProbe:
        spec = ServingProbeSpec(int(d["requests"]), int(d["prompt_len"]), int(d["output_len"]))
        return cls(spec, float(d["ttft_ms"]) / 1e3, tuple(float(t) / 1e3 for t in d.get("each_ttft_ms", ())))


def measure_serving(base_url: str, model: str, tokens: TokenSource, spec: ServingProbeSpec,
                    timeout_s: float = 120.0) -> ServingProbe:
    """The probe against a live target, one request at a time; every request must complete."""
    if spec.requests == 0:
        raise ValueError("the serving probe is off (requests = 0)")
    results, _ = asyncio.run(run_load(base_url, model, spec.specs(tokens), timeout_s, concurrency=1))
    measured = [request_metrics(r) for r in results[1:]]  # the first warms the path up
    if any(m is None for m in measured):
        errors = "; ".join(r.error for r in results if not r.ok)
        raise RuntimeError(f"serving probe failed at {base_url}: {errors}")
    each = tuple(m.ttft_s for m in measured)  # type: ignore[union-attr]
    return ServingProbe(spec, statistics.median(each), each)
