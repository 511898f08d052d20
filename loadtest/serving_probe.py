"""The serving probe: what the serving path adds to a request's TTFT, measured on an otherwise idle target.

The idle probe sends prompts of the workload's mean length (1,520 tokens on prefix-routing), so its TTFT is
mostly prefill; what HTTP, the Serve proxy, the router, placement and the first SSE event add is the small
difference between that TTFT and the simulator's scaled prefill, and a machine check a few percent off (the
2-core VMs drift by that within minutes) moves it by more than its size. The serving probe sends prompts so
short that their prefill is a few milliseconds, one at a time after a discarded warm-up: its TTFT is the
serving path's fixed part, give or take a prefill the profile times well (pdserve.sim.calibrate).

The serving path may also cost per prompt token (the token ids cross the proxy, the router and the replica
as JSON, and are validated and hashed). So the probe then sends one long prompt `cached_sends` times: once a
replica holds it in its prefix cache, a send's prefill is a block of new tokens, and its TTFT is the serving
path's for a long prompt. Each send's TTFT and cached tokens are kept (a send placed on a replica that has not
seen the prompt yet is a cold prefill). On the 2-core VMs (2026-12-02) the path read 2-7 ms and 1-7 µs a
prompt token.
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
    cached_len: int = 1024
    cached_sends: int = 7  # with round_robin over three replicas, the last four find the prompt cached

    def __post_init__(self) -> None:
        if (self.requests < 0 or self.prompt_len < 1 or self.output_len < 1 or self.cached_len < 1
                or self.cached_sends < 0):
            raise ValueError("a serving probe needs requests >= 0, prompt_len >= 1, output_len >= 1, "
                             "cached_len >= 1 and cached_sends >= 0")

    def specs(self, tokens: TokenSource) -> list[RequestSpec]:
        """The warm-up and the measured short requests, each a fresh prompt (no prefix-cache hit)."""
        rng = np.random.default_rng(PROBE_SEED)
        return [RequestSpec(tokens.random_ids(rng, self.prompt_len), self.output_len)
                for _ in range(self.requests + 1)]

    def cached_specs(self, tokens: TokenSource) -> list[RequestSpec]:
        """One long prompt, `cached_sends` times."""
        prompt = tokens.random_ids(np.random.default_rng([PROBE_SEED, 1]), self.cached_len)
        return [RequestSpec(prompt, self.output_len)] * self.cached_sends


@dataclass(frozen=True)
class ServingProbe:
    spec: ServingProbeSpec
    ttft_s: float  # median over the measured short requests
    each_ttft_s: tuple[float, ...]
    sends: tuple[tuple[float, int], ...] = ()  # the long prompt's sends: (TTFT, cached prompt tokens)

    @property
    def hits(self) -> list[tuple[float, int]]:
        """The sends that found at least half the long prompt cached."""
        return [(t, c) for t, c in self.sends if 2 * c >= self.spec.cached_len]

    @property
    def cached(self) -> tuple[float, int] | None:
        """(median TTFT, median cached tokens) of the hits; None without any (prefix caching off)."""
        hits = self.hits
        if not hits:
            return None
        return statistics.median(t for t, _ in hits), int(statistics.median(c for _, c in hits))

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.spec.requests, "prompt_len": self.spec.prompt_len,
                "output_len": self.spec.output_len, "ttft_ms": self.ttft_s * 1e3,
                "each_ttft_ms": [t * 1e3 for t in self.each_ttft_s], "cached_len": self.spec.cached_len,
                "cached_sends": [{"ttft_ms": t * 1e3, "cached_tokens": c} for t, c in self.sends]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServingProbe:
        sends = tuple((float(s["ttft_ms"]) / 1e3, int(s["cached_tokens"])) for s in d.get("cached_sends", ()))
        spec = ServingProbeSpec(int(d["requests"]), int(d["prompt_len"]), int(d["output_len"]),
                                int(d.get("cached_len", ServingProbeSpec.cached_len)), len(sends))
        return cls(spec, float(d["ttft_ms"]) / 1e3, tuple(float(t) / 1e3 for t in d.get("each_ttft_ms", ())), sends)


def measure_serving(base_url: str, model: str, tokens: TokenSource, spec: ServingProbeSpec,
                    timeout_s: float = 120.0) -> ServingProbe:
    """The probe against a live target, one request at a time; every request must complete."""
    if spec.requests == 0:
        raise ValueError("the serving probe is off (requests = 0)")
    results, _ = asyncio.run(run_load(base_url, model, spec.specs(tokens) + spec.cached_specs(tokens), timeout_s,
                                      concurrency=1))
    measured = [request_metrics(r) for r in results[1:]]  # the first warms the path up
    if any(m is None for m in measured):
        errors = "; ".join(r.error for r in results if not r.ok)
        raise RuntimeError(f"serving probe failed at {base_url}: {errors}")
    each = tuple(m.ttft_s for m in measured)  # type: ignore[union-attr]
    short, long = each[:spec.requests], each[spec.requests:]
    sends = tuple((t, r.cached_tokens) for t, r in zip(long, results[1 + spec.requests:]))
    return ServingProbe(spec, statistics.median(short), short, sends)
