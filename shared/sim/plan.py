"""The cluster plan from the simulator: at a GPU budget, the disaggregated split (prefill:decode replicas)
and the colocated shape with the highest simulated goodput, routers and Redis sized for it.

One replica is one GPU (an 8B model at TP 1). The search simulates one *unit* of `unit_gpus` GPUs over a
representative window (`window_s` of Poisson arrivals at each rate): for every split p + d = unit_gpus, and for
colocated replicas at each prefill-chunk budget, the unit's goodput is the highest rate whose SLO
attainment is >= `target` (doubling from a low rate until it fails, then bisecting). The budget is
served by replicating the best unit: goodput and replica counts scale linearly with the number of units
(independent units behind routers that place within a unit; cross-unit effects are not simulated).

Routers: enough that each holds at most `router_fill` of `max_inflight` requests in flight (Little's law
on the simulated mean E2E latency). Redis: the KV bytes of every prompt arriving in `redis_window_s`, an
upper bound for a prefix tier that keeps a window's prompts (shared prefixes are stored once, so less).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from pdserve.latency_model import LatencyProfile
from pdserve.loadtest.distributions import LengthDist
from pdserve.loadtest.slo import SLO
from pdserve.placement.policy import PlacementConfig
from pdserve.sim.cluster import Simulation
from pdserve.sim.config import ClusterSpec, EngineSpec, RouterSpec, SimRequest
from pdserve.sim.results import aggregate


@dataclass(frozen=True)
class PlanSpec:
    gpus: int = 1000
    unit_gpus: int = 8
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.05
    target: float = 0.9
    window_s: float = 30.0  # arrivals simulated per rate: 30x a 1 s TTFT SLO, so a backlog shows
    min_requests: int = 200
    chunk_budgets: tuple[int, ...] = (512, 2048)  # colocated: max_num_batched_tokens tried
    # also colocated without chunked prefill (a prompt runs whole in one step, budget 16384): the baseline
    # DistServe compared against; reported, never chosen as the colocated plan
    unchunked: bool = True
    # 8B bf16 on an 80 GiB H100 (docs/simulator.md), vLLM's default of 256 sequences a step
    engine: EngineSpec = field(default_factory=lambda: EngineSpec(max_num_seqs=256, num_blocks=29205))
    policy: str = "least_loaded"
    kv_part_tokens: int | None = 256  # RouterConfig.kv_part_tokens: KV in parts (pdserve.sim.handoff)
    max_inflight: int = 256  # RouterConfig.max_inflight
    router_fill: float = 0.5
    redis_window_s: float = 60.0
    redis_node_bytes: int = 64 << 30
    seed: int = 0
    bisect_steps: int = 5

    def __post_init__(self) -> None:
        if self.unit_gpus < 2 or self.gpus < self.unit_gpus:
            raise ValueError(f"unit_gpus must be >= 2 and <= gpus, got {self.unit_gpus} and {self.gpus}")
        if not (0 < self.target <= 1 and 0 < self.router_fill <= 1):
            raise ValueError("target and router_fill must be in (0, 1]")
        if self.kv_part_tokens is not None and self.kv_part_tokens < 1:
            raise ValueError(f"--kv-part-tokens must be >= 0 (0: whole), got {self.kv_part_tokens}")
        if self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0 or self.window_s <= 0 or self.min_requests < 10:
            raise ValueError("SLOs and window_s must be > 0 and min_requests >= 10")

    def num_requests(self, rate: float) -> int:
        return max(self.min_requests, math.ceil(rate * self.window_s))


Lengths = Callable[[np.random.Generator, int], list[tuple[int, int]]]  # (prompt, output) per request


def synthetic_lengths(prompt: LengthDist, output: LengthDist) -> Lengths:
    return lambda rng, n: list(zip(prompt.sample(rng, n), output.sample(rng, n)))


def trace_lengths(trace: Sequence[SimRequest]) -> Lengths:
    """A trace's (prompt, output) pairs, drawn with replacement."""
    pairs = [(r.prompt_tokens, r.output_tokens) for r in trace]
    return lambda rng, n: [pairs[i] for i in rng.integers(0, len(pairs), n)]


def window(lengths: Lengths, rate: float, n: int, seed: int) -> list[SimRequest]:
    """`n` Poisson arrivals at `rate` with lengths from `lengths` (the same seed: the same requests)."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    return [SimRequest(i, float(t), int(p), int(o)) for i, (t, (p, o)) in enumerate(zip(times, lengths(rng, n)))]


def find_rate(attainment: Callable[[float], float], start: float, target: float, steps: int) -> float:
    """The highest rate with attainment >= target: doubling from `start`, then `steps` bisections."""
    lo, hi, rate = 0.0, None, start
    for _ in range(16):
        if attainment(rate) < target:
            hi = rate
            break
        lo, rate = rate, rate * 2
    if hi is None:
        return lo
    for _ in range(steps):
        mid = math.sqrt(lo * hi) if lo else hi / 2
        if attainment(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo


def _shapes(spec: PlanSpec) -> list[tuple[str, ClusterSpec]]:
    router = RouterSpec(ttft_slo_s=spec.ttft_slo_s, tpot_slo_s=spec.tpot_slo_s,
                        placement=PlacementConfig(policy=spec.policy, admission="queue"),
                        kv_part_tokens=spec.kv_part_tokens)
    n = spec.unit_gpus
    out = [(f"disaggregated {p}P+{n - p}D", ClusterSpec("disaggregated", p, n - p, spec.engine, spec.engine, router))
           for p in range(1, n)]
    for budget in spec.chunk_budgets:
        engine = replace(spec.engine, max_num_batched_tokens=budget)
        out.append((f"colocated {n}x chunk {budget}", ClusterSpec("colocated", 0, n, engine, engine, router)))
    if spec.unchunked:
        engine = replace(spec.engine, max_num_batched_tokens=16384, enable_chunked_prefill=False)
        out.append((f"colocated {n}x no chunking", ClusterSpec("colocated", 0, n, engine, engine, router)))
    return out


def plan_cluster(profile: LatencyProfile, lengths: Lengths, spec: PlanSpec) -> dict[str, Any]:
    slo = SLO(spec.ttft_slo_s, spec.tpot_slo_s)
    mean_prompt = float(np.mean([p for p, _ in lengths(np.random.default_rng(spec.seed), 2000)]))
    start = spec.unit_gpus / max(4 * profile.for_role("prefill").prefill_time_s(round(mean_prompt)), 1e-3) / 8
    shapes: dict[str, dict[str, Any]] = {}
    for name, cluster in _shapes(spec):
        points: dict[float, dict[str, Any]] = {}

        def attainment(rate: float, cluster: ClusterSpec = cluster, points: dict = points) -> float:
            records = Simulation(cluster, profile, window(lengths, rate, spec.num_requests(rate), spec.seed)).run()
            points[rate] = aggregate(records, slo, rate)
            return points[rate]["slo_attainment"]

        rate = find_rate(attainment, start, spec.target, spec.bisect_steps)
        at = points.get(rate, {})
        shapes[name] = {"mode": cluster.mode, "prefill": cluster.num_prefill if cluster.mode == "disaggregated" else 0,
                        "decode": cluster.num_decode, "max_num_batched_tokens": cluster.decode.max_num_batched_tokens,
                        "unchunked": cluster.mode == "colocated" and not cluster.decode.enable_chunked_prefill,
                        "unit_goodput_rps": rate, "runs": len(points),
                        **{k: at.get(k) for k in ("slo_attainment", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s",
                                                  "tpot_p90_s")}}
    return {"slo": slo.to_dict(), "unit_gpus": spec.unit_gpus, "gpus": spec.gpus, "window_s": spec.window_s,
            "mean_prompt_tokens": mean_prompt, "shapes": shapes,
            "disaggregated": _scaled(profile, spec, shapes, "disaggregated", mean_prompt, lengths, slo),
            "colocated": _scaled(profile, spec, shapes, "colocated", mean_prompt, lengths, slo)}


def _scaled(profile: LatencyProfile, spec: PlanSpec, shapes: dict[str, dict[str, Any]], mode: str,
            mean_prompt: float, lengths: Lengths, slo: SLO) -> dict[str, Any]:
    """The best unit of `mode`, replicated over the budget, with its routers and Redis."""
    name, best = max(((k, v) for k, v in shapes.items() if v["mode"] == mode and not v["unchunked"]),
                     key=lambda kv: kv[1]["unit_goodput_rps"])
    units = spec.gpus // spec.unit_gpus
    rate = units * best["unit_goodput_rps"]
    e2e = 0.0
    if best["unit_goodput_rps"] > 0:
        cluster = next(c for k, c in _shapes(spec) if k == name)
        g = best["unit_goodput_rps"]
        records = Simulation(cluster, profile, window(lengths, g, spec.num_requests(g), spec.seed)).run()
        done = [r for r in records if r.finish_s is not None]
        e2e = float(np.mean([r.finish_s - r.request.arrival_s for r in done])) if done else 0.0
    routers = max(1, math.ceil(rate * e2e / (spec.max_inflight * spec.router_fill)))
    kv_bytes = profile.for_role("prefill").kv_bytes_per_token
    redis = rate * spec.redis_window_s * mean_prompt * kv_bytes
    return {"unit": name, "units": units, "gpus_used": units * spec.unit_gpus,
            "prefill_replicas": units * best["prefill"], "decode_replicas": units * best["decode"],
            "goodput_rps": rate, "goodput_per_gpu": rate / (units * spec.unit_gpus),
            "slo_attainment_at_goodput": best["slo_attainment"], "mean_e2e_s": e2e, "routers": routers,
            "redis_bytes": redis, "redis_nodes": math.ceil(redis / spec.redis_node_bytes)}
