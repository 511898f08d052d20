"""A committed load-test scenario (loadtest/scenarios/*.yaml) through the simulator: each target's system
as a ClusterSpec, the scenario's workload, arrivals and seeds at each sweep rate, the same SLOs, and the
goodput found by the load tests' own sweep (pdserve.loadtest.sweep.find_goodput)."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from pdserve.latency_model import LatencyProfile
from pdserve.loadtest.evaluate import PROBE_SEED
from pdserve.loadtest.runner import LoadConfig
from pdserve.loadtest.scenario import Scenario
from pdserve.loadtest.slo import SLO, IdleLatency, SLOSpec
from pdserve.loadtest.sweep import SweepConfig, find_goodput
from pdserve.loadtest.workloads import workload
from pdserve.placement.policy import PlacementConfig
from pdserve.sim.cluster import Simulation
from pdserve.sim.config import ClusterSpec, EngineSpec, RouterSpec, SimRequest
from pdserve.sim.results import aggregate
from pdserve.sim.workload import requests_for

# the live defaults (services/worker.py WorkerConfig, services/router/config.py RouterConfig) the scenarios
# leave unset
# the worker's 128 MiB of float16 KV (its CPU default) holds as many tokens as 256 MiB at the float32
# bytes per token of the committed CPU profiles
KV_MEMORY_BYTES = 256 << 20
ROUTER_SLO_TTFT_S, ROUTER_SLO_TPOT_S, ROUTER_MIN_PROMPT, ROUTER_KV_PART_TOKENS = 2.0, 0.2, 32, 256


def load_profile(path: str | Path) -> LatencyProfile:
    """A profile file, or a one-line ValueError naming it."""
    try:
        return LatencyProfile.load(path)
    except OSError as exc:
        raise ValueError(f"cannot read profile {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a latency profile ({type(exc).__name__}: {exc})") from None


def engine_spec(worker: dict[str, Any], profile: LatencyProfile, role: str) -> EngineSpec:
    block_size = int(worker.get("block_size", 16))
    kv_bytes = profile.for_role(role).kv_bytes_per_token * block_size
    num_blocks = worker.get("num_blocks") or max(1, int(worker.get("kv_memory_bytes", KV_MEMORY_BYTES)) // kv_bytes)
    return EngineSpec(max_num_seqs=int(worker.get("max_num_seqs", 64)),
                      max_num_batched_tokens=int(worker.get("max_num_batched_tokens", 2048)),
                      enable_chunked_prefill=bool(worker.get("enable_chunked_prefill", True)),
                      num_blocks=int(num_blocks), block_size=block_size,
                      num_threads=max(1, int(float(worker.get("num_cpus", 1.0)))))


def cluster_spec(system: dict[str, Any], profile: LatencyProfile) -> ClusterSpec:
    """A target's SystemConfig fields (mode, transport, prefill/decode/router overrides) as a ClusterSpec."""
    mode = system.get("mode", "disaggregated")
    prefill, decode, router = (dict(system.get(k) or {}) for k in ("prefill", "decode", "router"))
    placement = PlacementConfig.model_validate({
        "disaggregate_min_prompt_tokens": router.get("disaggregate_min_prompt_tokens", ROUTER_MIN_PROMPT),
        **router.get("placement", {})})
    return ClusterSpec(
        mode=mode, num_prefill=int(prefill.get("num_replicas", 1)), num_decode=int(decode.get("num_replicas", 1)),
        prefill=engine_spec(prefill, profile, "prefill"), decode=engine_spec(decode, profile, "decode"),
        router=RouterSpec(num_routers=int(router.get("num_replicas", 1)), placement=placement,
                          ttft_slo_s=float(router.get("slo_ttft_s", ROUTER_SLO_TTFT_S)),
                          tpot_slo_s=float(router.get("slo_tpot_s", ROUTER_SLO_TPOT_S)),
                          has_profile=bool(router.get("profile_path") or router.get("profile")),
                          kv_part_tokens=router.get("kv_part_tokens", ROUTER_KV_PART_TOKENS)),
        transport=system.get("transport", "ucx"))


def idle_latency(spec: ClusterSpec, profile: LatencyProfile, requests: list[SimRequest]) -> IdleLatency:
    """One request of the workload's mean lengths, alone (what measure_idle probes live)."""
    prompt = max(1, round(sum(r.prompt_tokens for r in requests) / len(requests)))
    output = max(2, round(sum(r.output_tokens for r in requests) / len(requests)))
    (record,) = Simulation(spec, profile, [SimRequest(0, 0.0, prompt, output)]).run()
    return IdleLatency(record.ttft_s, record.tpot_s)  # type: ignore[arg-type]


def cached_ttft(spec: ClusterSpec, profile: LatencyProfile, prompt_tokens: int, cached_tokens: int,
                output_tokens: int = 2) -> float:
    """TTFT of a prompt sent again to the replica that served it, `cached_tokens` of it found in the prefix
    cache (what pdserve.loadtest.serving_probe's cached sends measure live)."""
    one = dataclasses.replace(spec, num_prefill=1, num_decode=1)
    block = spec.prefill.block_size if spec.mode == "disaggregated" else spec.decode.block_size
    full, hit = prompt_tokens // block, min(cached_tokens, prompt_tokens - 1) // block
    first = SimRequest(0, 0.0, prompt_tokens, max(2, output_tokens), tuple(range(1, full + 1)))
    again = SimRequest(1, 1e3, prompt_tokens, max(2, output_tokens),
                       tuple(range(1, hit + 1)) + tuple(-h for h in range(hit + 1, full + 1)))
    _, record = Simulation(one, profile, [first, again]).run()
    return record.ttft_s  # type: ignore[return-value]


def batch_latency(spec: ClusterSpec, profile: LatencyProfile, k: int, prompt_tokens: int, output_tokens: int) -> float:
    """Median TPOT of `k` requests of these lengths arriving together on an idle system (what
    pdserve.loadtest.batch_probe measures live)."""
    records = Simulation(spec, profile, [SimRequest(i, 0.0, prompt_tokens, output_tokens) for i in range(k)]).run()
    return statistics.median(r.tpot_s for r in records)  # type: ignore[type-var]


def simulate_scenario(scenario: Scenario, profile: LatencyProfile, rates: tuple[float, ...] | None = None,
                      num_requests: int | None = None) -> dict[str, Any]:
    """Per target: the figures at each rate (the scenario's sweep grid, or `rates`) and the goodput."""
    work = workload(scenario.workload)
    load = scenario.load.config(scenario.seed)
    if num_requests is not None:
        load = LoadConfig(num_requests, load.max_duration_s, load.arrival, load.burstiness, load.seed)
    sweep = scenario.sweep.config()
    if rates is not None:
        sweep = SweepConfig(tuple(rates), max(sweep.max_runs, len(rates)), sweep.rel_tol, sweep.target)
    spec_slo = SLOSpec.from_dict(scenario.slo)
    specs = {t.name: cluster_spec(t.system, profile) for t in scenario.targets}
    slo: SLO | None = None
    targets: dict[str, Any] = {}
    for name, spec in specs.items():
        block = spec.decode.block_size
        if slo is None:
            idle = None
            if spec_slo.needs_reference:
                probe = requests_for(work, LoadConfig(64, 1.0, "poisson", 1.0, PROBE_SEED), 1.0, block)
                idle = idle_latency(spec, profile, probe)
            slo = spec_slo.resolve(idle)
        points: dict[float, dict[str, Any]] = {}

        def measure(rate: float, spec: ClusterSpec = spec, points: dict = points, slo: SLO = slo) -> float:
            records = Simulation(spec, profile, requests_for(work, load, rate, spec.decode.block_size)).run()
            points[rate] = aggregate(records, slo, rate, load.max_duration_s)
            return points[rate]["slo_attainment"]

        result = find_goodput(measure, sweep)
        targets[name] = {"mode": spec.mode, "goodput": result.goodput, "goodput_capped": result.capped,
                         "points": {f"{r:g}": points[r] for r in sorted(points)}}
    return {"scenario": scenario.name, "slo": slo.to_dict() if slo else None, "targets": targets}
