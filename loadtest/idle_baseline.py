"""Idle latency only, of the disagg-vs-colocated scenario's targets and of the colocated target it had until
run 12 (one replica with two CPUs): issue #34, "fair baselines".

    python -m pdserve.loadtest.idle_baseline --json [--idle-requests 6] [--scenario PATH]

Each target is deployed with the scenario runner's own `deployed` and probed with its own `measure_idle`
(one discarded warm-up request, then `--idle-requests` sequential requests of the workload's mean length);
the per-request values are those `measure_idle` took its medians from, recorded as they pass. No sweep.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pdserve.loadtest.scenario import Scenario, TargetSpec

DEFAULT_SCENARIO = Path(__file__).parent / "scenarios" / "disagg-vs-colocated.yaml"
OLD_TARGET = "colocated-old-2cpu"
BASELINE = "disaggregated"


DEFAULT_NUM_CPUS = 1.0  # WorkerConfig.num_cpus's default


def idle_targets(scenario: Scenario, old_from: str = "colocated-no-chunking") -> list[TargetSpec]:
    """The scenario's targets, then the colocated target as it was until run 12: `old_from` with one
    replica of two CPUs (everything else as it is)."""
    base = next(t for t in scenario.targets if t.name == old_from)
    decode = {**base.system.get("decode", {}), "num_replicas": 1, "num_cpus": 2}
    return [*scenario.targets, TargetSpec(name=OLD_TARGET, system={**base.system, "decode": decode})]


def configured_threads(system: dict[str, Any]) -> dict[str, int]:
    """role -> the torch thread count its worker sets: WorkerConfig.engine_config's max(1, int(num_cpus)),
    read from the system's dict (the load tester never imports the services)."""
    roles = ("prefill", "decode") if system.get("mode", "disaggregated") == "disaggregated" else ("decode",)
    return {role: max(1, int(system.get(role, {}).get("num_cpus", DEFAULT_NUM_CPUS))) for role in roles}


def os_threads(pid: int) -> int | None:
    """The process's OS thread count (/proc/PID/status `Threads`): torch's intra-op pool among Ray's own."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def ratios(targets: dict[str, dict[str, Any]], baseline: str = BASELINE) -> dict[str, dict[str, float]]:
    """target -> its idle TPOT and TTFT p50 over the baseline's, for every target but the baseline."""
    base = targets[baseline]
    return {name: {"tpot": t["tpot_ms_p50"] / base["tpot_ms_p50"], "ttft": t["ttft_ms_p50"] / base["ttft_ms_p50"]}
            for name, t in targets.items() if name != baseline}


@contextmanager
def recorded_probe() -> Iterator[list[list[Any]]]:
    """Records the request results of each `measure_idle` call (its `run_load`), unchanged."""
    from pdserve.loadtest import evaluate

    seen: list[list[Any]] = []
    original = evaluate.run_load

    async def recording(*args: Any, **kwargs: Any) -> Any:
        results, duration = await original(*args, **kwargs)
        seen.append(results)
        return results, duration

    evaluate.run_load = recording
    try:
        yield seen
    finally:
        evaluate.run_load = original


def probe_target(local: Any, target: TargetSpec, scenario: Scenario, model: Any, tokens: Any, work: Any,
                 idle_requests: int, log: Any) -> dict[str, Any]:
    from pdserve.loadtest.evaluate import measure_idle
    from pdserve.loadtest.metrics import request_metrics
    from pdserve.loadtest.scenario import _served_name
    from pdserve.loadtest.targets import deployed
    from pdserve.proc_cpu import serve_replica_pids

    system = {"model": model, **target.system}
    app = f"idle-{target.name}"
    log(f"[{target.name}] deploying")
    with deployed(local, system, app, scenario.route_prefix, scenario.health_timeout_s) as url:
        name = _served_name(url)
        with recorded_probe() as seen:
            idle = measure_idle(url, name, tokens, work, idle_requests)
        warmup, *measured = seen[-1]
        metrics = [request_metrics(r) for r in measured]
        replicas = [{"pid": pid, "deployment": dep, "os_threads": os_threads(pid)}
                    for pid, dep in sorted(serve_replica_pids(app).items(), key=lambda kv: kv[1])]
    out = {
        "ttft_ms_p50": idle.ttft_s * 1e3, "tpot_ms_p50": idle.tpot_s * 1e3,
        "ttft_ms": [round(m.ttft_s * 1e3, 1) for m in metrics],
        "tpot_ms": [round(m.tpot_s * 1e3, 2) for m in metrics],
        "tpot_ms_stdev": statistics.stdev(m.tpot_s * 1e3 for m in metrics) if len(metrics) > 1 else 0.0,
        "prompt_len": measured[0].prompt_len, "output_len": measured[0].expected_output_len,
        "output_tokens": [m.output_tokens for m in metrics],
        "warmup": {"ttft_ms": round(warmup.chunk_times[0] * 1e3, 1) if warmup.chunk_times else None},
        "torch_threads_configured": configured_threads(system),
        "replicas": replicas,
        "loadavg_1m_after": round(os.getloadavg()[0], 2),  # the machine is shared: anything else running shows here
        "system": target.system,
    }
    log(f"[{target.name}] idle TTFT {out['ttft_ms_p50']:.0f} ms, TPOT {out['tpot_ms_p50']:.1f} ms "
        f"(TPOT per request {out['tpot_ms']})")
    return out


def run(scenario: Scenario, idle_requests: int, only: list[str] | None = None,
        log: Any = lambda s: print(s, file=sys.stderr, flush=True)) -> dict[str, Any]:
    from pdserve.loadtest.models import resolve_model
    from pdserve.loadtest.provenance import provenance
    from pdserve.loadtest.targets import local_serve
    from pdserve.loadtest.workloads import TokenSource, workload

    model = resolve_model(scenario.model)
    tokens = TokenSource.for_model(model)
    work = workload(scenario.workload)
    targets = [t for t in idle_targets(scenario) if not only or t.name in only]
    results: dict[str, dict[str, Any]] = {}
    with local_serve(scenario.ray) as local:
        for target in targets:
            results[target.name] = probe_target(local, target, scenario, model, tokens, work, idle_requests, log)
    out: dict[str, Any] = {"scenario": scenario.name, "model": str(model), "idle_requests": idle_requests,
                           "targets": results, "provenance": provenance()}
    if BASELINE in results:
        out["ratio_over_disaggregated"] = ratios(results)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.loadtest.idle_baseline", description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", type=Path, default=DEFAULT_SCENARIO)
    parser.add_argument("--idle-requests", type=int, default=6)
    parser.add_argument("--only", nargs="*", help="target names (default: all, and the old colocated one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object (else a short table)")
    args = parser.parse_args(argv)
    # Ray's processes inherit stdout and write to it (a raylet line at shutdown): they get stderr, so that
    # stdout holds only the JSON
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        out = run(Scenario.from_yaml(args.scenario), args.idle_requests, args.only)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        for name, t in out["targets"].items():
            ratio = out.get("ratio_over_disaggregated", {}).get(name, {}).get("tpot")
            print(f"{name:24s} TTFT p50 {t['ttft_ms_p50']:7.0f} ms  TPOT p50 {t['tpot_ms_p50']:6.2f} ms"
                  + (f"  ({ratio:.2f}x)" if ratio else "") + f"  threads {t['torch_threads_configured']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
