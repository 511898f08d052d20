"""Scenario files: targets (pdserve SystemConfigs) deployed one after another on a local Ray Serve,
each measured idle and then swept for goodput under the same workload and SLO.

Relative SLOs (`ttft_factor`, `tpot_factor`) multiply the idle latency of the FIRST target, the
baseline: every target is then judged against the same absolute bounds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.loadtest.batch_probe import BatchProbeSpec, measure_batch
from pdserve.loadtest.client import new_client, served_model
from pdserve.loadtest.evaluate import TargetResult, measure_idle, measure_quiet_cpu, sweep_target
from pdserve.loadtest.provenance import provenance
from pdserve.loadtest.runner import LoadConfig
from pdserve.loadtest.serving_probe import ServingProbeSpec, measure_serving
from pdserve.loadtest.slo import SLOSpec
from pdserve.loadtest.sweep import SweepConfig
from pydantic import BaseModel, ConfigDict, Field, model_validator

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class TargetSpec(BaseModel):
    model_config = _FROZEN
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    system: dict[str, Any] = Field(default_factory=dict)  # SystemConfig fields; `model` defaults to the scenario's


class LoadSpec(BaseModel):
    model_config = _FROZEN
    num_requests: int = Field(100, ge=1)
    max_duration_s: float = Field(300.0, gt=0)
    arrival: str = "poisson"
    burstiness: float = Field(1.0, gt=0)

    def config(self, seed: int) -> LoadConfig:
        return LoadConfig(self.num_requests, self.max_duration_s, self.arrival, self.burstiness, seed)


class SweepSpec(BaseModel):
    model_config = _FROZEN
    rates: tuple[float, ...] = (0.5, 1.0, 2.0)
    max_runs: int = Field(6, ge=1)
    rel_tol: float = Field(0.1, gt=0)
    target: float = Field(0.9, gt=0, le=1)

    def config(self) -> SweepConfig:
        return SweepConfig(tuple(self.rates), self.max_runs, self.rel_tol, self.target)


class Scenario(BaseModel):
    model_config = _FROZEN
    name: str
    description: str = ""
    model: str | dict[str, Any] = "tiny"  # "tiny", a checkpoint path, or {random_llama: {...}}
    seed: int = 0
    ray: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 4})  # ray.init options when we start Ray
    route_prefix: str = "/"
    health_timeout_s: float = Field(180.0, gt=0)
    workload: dict[str, Any] = Field(default_factory=lambda: {"kind": "synthetic", "prompt": 128, "output": 32})
    load: LoadSpec = Field(default_factory=LoadSpec)
    sweep: SweepSpec = Field(default_factory=SweepSpec)
    slo: dict[str, float] = Field(default_factory=lambda: {"ttft_factor": 5.0, "tpot_factor": 2.0})
    idle_requests: int = Field(3, ge=1)
    batch_probe_requests: int = Field(8, ge=0)  # the batch probe's k (pdserve.loadtest.batch_probe); 0: none
    serving_probe_requests: int = Field(5, ge=0)  # short-prompt TTFT probe (pdserve.loadtest.serving_probe); 0: none
    # the latency profile this scenario's absolute SLOs were set against: the runner measures this machine
    # first and reports how much slower or faster it is (pdserve.loadtest.machine); so is every profile a
    # target's router reads
    machine_profile: str | None = None
    cdf_rate: float | None = None  # a sweep grid rate; None: the middle one
    targets: tuple[TargetSpec, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _check(self) -> Scenario:
        SLOSpec.from_dict(self.slo)
        self.sweep.config()
        if self.cdf_rate is not None and self.cdf_rate not in self.sweep.rates:
            raise ValueError("cdf_rate must be one of sweep.rates (those are measured for every target)")
        if len({t.name for t in self.targets}) != len(self.targets):
            raise ValueError("target names must be unique")
        if not self.route_prefix.startswith("/"):
            raise ValueError("route_prefix must start with '/'")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> Scenario:
        import yaml

        with open(path, encoding="utf-8") as f:
            return cls.model_validate(yaml.safe_load(f) or {})

    @property
    def chosen_cdf_rate(self) -> float:
        return self.cdf_rate if self.cdf_rate is not None else self.sweep.rates[len(self.sweep.rates) // 2]


def _served_name(url: str) -> str:
    import asyncio

    async def ask() -> str:
        async with new_client(1) as client:
            return await served_model(client, url)

    return asyncio.run(ask())


def run_scenario(
    scenario: Scenario, out_dir: Path, *, progress: bool | None = None, log: Callable[[str], None] = print,
    port: int = 0,
) -> dict[str, Any]:
    """Runs every target in order and writes summary.json, summary.md and the plots into out_dir."""
    from pdserve.loadtest.contention import for_scenario
    from pdserve.loadtest.machine import check_machine, describe, profile_paths, replica_threads
    from pdserve.loadtest.models import resolve_model
    from pdserve.loadtest.placement_bound import scenario_bound
    from pdserve.loadtest.report import write_report
    from pdserve.loadtest.targets import deployed, local_serve
    from pdserve.loadtest.workloads import TokenSource, workload

    out_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model(scenario.model)
    tokens = TokenSource.for_model(model)
    work = workload(scenario.workload)
    load, sweep = scenario.load.config(scenario.seed), scenario.sweep.config()
    slo_spec = SLOSpec.from_dict(scenario.slo)
    slo = None
    results: list[TargetResult] = []
    started = time.monotonic()
    paths = profile_paths(scenario.machine_profile, (t.system for t in scenario.targets))

    def machine_check(target: TargetSpec) -> list[dict[str, Any]]:
        """Before each target, at its replicas' threads: the machine's speed can move between targets (a
        cloud VM's does)."""
        threads = replica_threads(target.system)
        checks = [check.to_dict() for check in check_machine(str(model), paths, threads=threads)]
        for check in checks:
            log(f"[{target.name}] machine ({check['verdict']}): {describe(check)}")
        return checks

    machine = machine_check(scenario.targets[0])  # before Ray starts: a bad profile path fails first
    contention = for_scenario(str(model), [t.system for t in scenario.targets], os.cpu_count())
    if contention:
        log(f"contention: {contention['copies']} one-thread engines on {contention['cores']:g} cores, "
            f"prefill {contention['prefill_ratio']:.2f}x and decode {contention['decode_ratio']:.2f}x alone "
            f"(fair share {contention['fair_share']:.2f}x)")
    # on a trace, what any placement could save on it, beside what each target measures
    bound = scenario_bound(scenario) if scenario.workload.get("kind") == "mooncake" else None
    with local_serve(scenario.ray, port) as local:
        for i, target in enumerate(scenario.targets):
            checks = machine if i == 0 else machine_check(target)
            system = {"model": model, **target.system}
            app = f"loadtest-{target.name}"
            log(f"[{target.name}] deploying {system.get('mode', 'disaggregated')} system")
            with deployed(local, system, app, scenario.route_prefix, scenario.health_timeout_s) as url:
                name = _served_name(url)
                idle = measure_idle(url, name, tokens, work, scenario.idle_requests)
                log(f"[{target.name}] idle TTFT {idle.ttft_s * 1e3:.0f} ms, TPOT {idle.tpot_s * 1e3:.1f} ms")
                batch = None
                if scenario.batch_probe_requests:
                    batch = measure_batch(url, name, tokens, BatchProbeSpec(k=scenario.batch_probe_requests))
                    log(f"[{target.name}] batch probe: {batch.spec.k} together, TPOT {batch.tpot_s * 1e3:.2f} ms")
                serving = None
                if scenario.serving_probe_requests:
                    serving = measure_serving(url, name, tokens,
                                              ServingProbeSpec(requests=scenario.serving_probe_requests))
                    cached = serving.cached
                    log(f"[{target.name}] serving probe: {serving.spec.prompt_len}-token prompts, TTFT "
                        f"{serving.ttft_s * 1e3:.1f} ms; {serving.spec.cached_len}-token prompt cached: "
                        + (f"TTFT {cached[0] * 1e3:.1f} ms ({cached[1]} tokens hit)" if cached else "no hit"))
                if slo is None:
                    slo = slo_spec.resolve(idle)
                    log(f"SLO (from {target.name}): TTFT <= {slo.ttft_s * 1e3:.0f} ms, "
                        f"TPOT <= {slo.tpot_s * 1e3:.1f} ms")
                quiet = measure_quiet_cpu(app)
                result = sweep_target(target.name, url, name, tokens, work, load, sweep, slo, out_dir,
                                      idle=idle, progress=progress, log=log, app=app)
                result.system, result.machine, result.quiet_cpu = system, checks, quiet
                result.batch_probe, result.serving_probe = batch, serving
                results.append(result)
                log(f"[{target.name}] goodput {result.sweep.goodput:.3g} req/s"
                    + (" (every rate passed: at least)" if result.sweep.capped else ""))
    meta = {"scenario": scenario.name, "description": scenario.description, "model": str(model),
            "workload": scenario.workload, "load": scenario.load.model_dump(), "sweep": scenario.sweep.model_dump(),
            "slo_spec": scenario.slo, "slo_reference": scenario.targets[0].name,
            "machine": machine, "contention": contention, "placement_bound": bound,
            "wall_time_s": time.monotonic() - started,
            "provenance": provenance()}
    return write_report(out_dir, results, slo, scenario.chosen_cdf_rate, sweep.target, meta)
