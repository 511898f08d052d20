"""One target, end to end: its idle latency, then a goodput sweep; every run saved as JSON."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pdserve.loadtest.batch_probe import BatchProbe
from pdserve.loadtest.distributions import Fixed
from pdserve.loadtest.engine_steps import StepMeter, replica_reader
from pdserve.loadtest.metrics import request_metrics
from pdserve.loadtest.runner import LoadConfig, Run, run_load, run_point
from pdserve.loadtest.serving_probe import ServingProbe
from pdserve.loadtest.slo import SLO, IdleLatency, attainment, request_goodput
from pdserve.loadtest.sweep import SweepConfig, SweepResult, find_goodput
from pdserve.loadtest.workloads import Synthetic, TokenSource, Workload
from pdserve.proc_cpu import HostCPU, ReplicaCPU

PROBE_SEED = 0x1D1E


@dataclass
class TargetResult:
    name: str
    idle: IdleLatency | None
    sweep: SweepResult
    runs: dict[float, Run] = field(default_factory=dict)
    slo: SLO | None = None
    system: dict[str, Any] = field(default_factory=dict)
    # rate -> deployment -> CPU seconds its replicas burned during that run (pdserve.proc_cpu)
    cpu: dict[float, dict[str, float]] = field(default_factory=dict)
    # rate -> {"host": CPU seconds every core spent busy, "client": this process's} during that run
    host_cpu: dict[float, dict[str, float]] = field(default_factory=dict)
    # rate -> role -> its engines' stepping time during that run, summed (pdserve.loadtest.engine_steps)
    steps: dict[float, dict[str, Any]] = field(default_factory=dict)
    # CPU seconds over a quiet window before the sweep (measure_quiet_cpu): what the host burns with no load
    quiet_cpu: dict[str, Any] | None = None
    # the machine checks measured just before this target was deployed (pdserve.loadtest.machine)
    machine: list[dict[str, Any]] = field(default_factory=list)
    batch_probe: BatchProbe | None = None  # k requests decoding together, before the sweep
    serving_probe: ServingProbe | None = None  # short prompts one at a time: the serving path's TTFT

    def attainment_at(self, rate: float) -> float:
        return self.sweep.points[rate]

    def cpu_per_request(self, rate: float) -> dict[str, float] | None:
        """Deployment -> replica CPU seconds per completed request at `rate`, with "all" their sum; None
        when not measured or nothing completed."""
        cpu, run = self.cpu.get(rate), self.runs.get(rate)
        if not cpu or run is None or not run.summary.counts.completed:
            return None
        n = run.summary.counts.completed
        return {**{dep: s / n for dep, s in cpu.items()}, "all": sum(cpu.values()) / n}

    def goodput_at(self, rate: float) -> float:
        run = self.runs[rate]
        return request_goodput(run.results, self.slo, run.duration_s)


def probe_workload(workload: Workload, tokens: TokenSource, seed: int = PROBE_SEED, sample: int = 64) -> Synthetic:
    """Requests of the workload's mean prompt and output length, with prompts of their own (no cache hits)."""
    try:
        specs = workload.requests(tokens, sample, seed)
    except ValueError:  # a short data set: what it has
        specs = workload.requests(tokens, 4, seed)
    prompt = max(1, round(float(np.mean([s.prompt_len for s in specs]))))
    output = max(2, round(float(np.mean([s.output_len for s in specs]))))
    return Synthetic(Fixed(prompt), Fixed(output))


def measure_idle(base_url: str, model: str, tokens: TokenSource, workload: Workload, num_requests: int = 3,
                 timeout_s: float = 120.0) -> IdleLatency:
    """Median TTFT and TPOT of `num_requests` sequential requests, after one discarded warm-up request."""
    specs = probe_workload(workload, tokens).requests(tokens, num_requests + 1, PROBE_SEED)
    results, _ = asyncio.run(run_load(base_url, model, specs, timeout_s, concurrency=1))
    measured = [request_metrics(r) for r in results[1:]]
    if any(m is None for m in measured):
        errors = "; ".join(r.error for r in results if not r.ok)
        raise RuntimeError(f"idle probe failed at {base_url}: {errors}")
    return IdleLatency(statistics.median(m.ttft_s for m in measured),
                       statistics.median(m.tpot_s for m in measured))


def measure_quiet_cpu(app: str, seconds: float = 10.0) -> dict[str, Any]:
    """The host's, this process's and the app's replicas' CPU seconds over `seconds` with no request in flight:
    Ray's and Serve's own processes, the routers' polling, the replicas' idle loops."""
    replicas, host = ReplicaCPU(app), HostCPU()
    replicas.start()
    host.start()
    time.sleep(seconds)
    return {"seconds": seconds, **host.stop(), "replicas": replicas.stop()}


def sweep_target(
    name: str, base_url: str, model: str, tokens: TokenSource, workload: Workload, load: LoadConfig,
    sweep: SweepConfig, slo: SLO, out_dir: Path, *, idle: IdleLatency | None = None,
    progress: bool | None = None, log: Callable[[str], None] = print, app: str | None = None,
) -> TargetResult:
    """`app`: the Serve app's name when it runs on this machine; each run then also records its replicas'
    CPU time (pdserve.proc_cpu)."""
    result = TargetResult(name, idle, SweepResult(), slo=slo)
    runs_dir = out_dir / "runs" / name
    runs_dir.mkdir(parents=True, exist_ok=True)

    def measure(rate: float) -> float:
        meters = (ReplicaCPU(app), HostCPU(), StepMeter(replica_reader(app))) if app else None
        if meters is not None:
            for m in meters:
                m.start()
        run = run_point(base_url, model, tokens, workload, load, rate=rate, progress=progress,
                        label=f"{name} @ {rate:.3g} req/s")
        result.runs[rate] = run
        if meters is not None:
            result.cpu[rate], result.host_cpu[rate], result.steps[rate] = (m.stop() for m in meters)
        value = attainment(run.results, slo)
        c = run.summary.counts
        log(f"  {name} @ {rate:.3g} req/s: attainment {value:.0%}, {c.completed}/{c.total} completed "
            f"({c.rejected} rejected, {c.errors} errors, {c.cancelled} cancelled) in {run.duration_s:.1f} s")
        record = {"target": name, "rate": rate, "attainment": value,
                  "goodput": request_goodput(run.results, slo, run.duration_s), "slo": slo.to_dict(),
                  "replica_cpu_s": result.cpu.get(rate), "host_cpu_s": result.host_cpu.get(rate),
                  "engine_steps": result.steps.get(rate), **run.to_dict()}
        (runs_dir / f"rate-{rate:.4g}.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        return value

    result.sweep = find_goodput(measure, sweep)
    return result
