"""`python -m pdserve.sim`: the discrete-event model of a pdserve system. Prints one JSON object.

    python -m pdserve.sim scenario loadtest/scenarios/router-policies.yaml [--profile P] [--rates 0.5,1]
    python -m pdserve.sim trace loadtest/scenarios/traces/prefix-routing.jsonl --profile P [--mode colocated]
    python -m pdserve.sim autoscale [--duration-s 7200] [--rate 20]   (H100 8B roofline profile by default)
    python -m pdserve.sim plan --workload chat --gpus 1000 [--trace T] [--profile P]   (the cluster plan)

A missing or malformed scenario, trace or profile file: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _rates(text: str | None) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        return tuple(float(r) for r in text.split(","))
    except ValueError:
        raise ValueError(f"--rates: comma-separated numbers, got {text!r}") from None


def scenario_main(args: argparse.Namespace) -> dict[str, Any]:
    import yaml
    from pdserve.loadtest.scenario import Scenario
    from pdserve.sim.scenario import load_profile, simulate_scenario

    try:
        scenario = Scenario.from_yaml(args.file)
    except OSError as exc:
        raise ValueError(f"cannot read scenario {args.file}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{args.file}: not YAML ({str(exc).splitlines()[0]})") from None
    path = args.profile or scenario.machine_profile or next(
        (t.system.get("router", {}).get("profile_path") for t in scenario.targets
         if t.system.get("router", {}).get("profile_path")), None)
    if path is None:
        raise ValueError(f"{args.file} names no latency profile (machine_profile or router.profile_path): "
                         "give --profile")
    result = simulate_scenario(scenario, load_profile(path), _rates(args.rates), args.requests)
    return {"command": " ".join([getattr(args, "prog", "python -m pdserve.sim"), *sys.argv[1:]]),
            "profile": str(path), **result}


def trace_main(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import replace

    from pdserve.loadtest.slo import SLO
    from pdserve.placement.policy import PlacementConfig
    from pdserve.sim.cluster import Simulation
    from pdserve.sim.config import ClusterSpec, RouterSpec
    from pdserve.sim.results import aggregate, per_request
    from pdserve.sim.scenario import engine_spec, load_profile
    from pdserve.sim.workload import load_trace

    if args.rate_scale <= 0 or args.ttft_ms <= 0 or args.tpot_ms <= 0:
        raise ValueError("--rate-scale, --ttft-ms and --tpot-ms must be > 0")
    profile = load_profile(args.profile)
    slo = SLO(args.ttft_ms / 1e3, args.tpot_ms / 1e3)
    worker = {"max_num_batched_tokens": args.max_num_batched_tokens, "enable_chunked_prefill": not args.no_chunking}
    spec = ClusterSpec(
        mode=args.mode, num_prefill=args.prefill, num_decode=args.decode,
        prefill=engine_spec(worker, profile, "prefill"), decode=engine_spec(worker, profile, "decode"),
        router=RouterSpec(num_routers=args.routers, ttft_slo_s=slo.ttft_s, tpot_slo_s=slo.tpot_s,
                          placement=PlacementConfig(policy=args.policy, admission="queue")))
    requests = [replace(r, arrival_s=r.arrival_s / args.rate_scale)
                for r in load_trace(args.file, args.trace_block_size, spec.decode.block_size)]
    records = Simulation(spec, profile, requests).run()
    out = {"trace": args.file, "profile": args.profile, "mode": args.mode, "slo": slo.to_dict(),
           **aggregate(records, slo)}
    if args.per_request:
        out["requests"] = per_request(records)
    return out


def autoscale_main(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.autoscale import AutoscaleConfig, RoleBounds
    from pdserve.bench.placement import h100_8b_profile
    from pdserve.placement.policy import PlacementConfig
    from pdserve.sim.config import ClusterSpec, EngineSpec, RouterSpec
    from pdserve.sim.scenario import load_profile
    from pdserve.sim.shift import ShiftTrace, run_shift

    profile = load_profile(args.profile) if args.profile else h100_8b_profile()
    ttft, tpot = args.ttft_ms / 1e3, args.tpot_ms / 1e3
    engine = EngineSpec(num_blocks=args.num_blocks)
    spec = ClusterSpec(mode="disaggregated", prefill=engine, decode=engine, startup_s=args.startup_s,
                       router=RouterSpec(ttft_slo_s=ttft, tpot_slo_s=tpot, placement=PlacementConfig(
                           policy=args.policy, admission="queue", transport="ucx")))
    config = AutoscaleConfig(ttft_slo_s=ttft, tpot_slo_s=tpot, prefill=RoleBounds(1, args.max_replicas),
                             decode=RoleBounds(1, args.max_replicas))
    trace = ShiftTrace(duration_s=args.duration_s, mean_rate=args.rate, seed=args.seed)
    result = run_shift(profile, spec, trace, config, window_s=args.window_s, compare_static=not args.no_static,
                       search_static=args.search_static)
    return {"command": "python -m pdserve.sim " + " ".join(sys.argv[1:]),
            "profile": args.profile or "h100_8b_profile (pdserve.bench.placement)",
            "trace": {"duration_s": trace.duration_s, "mean_rate": trace.mean_rate, "swing": trace.swing,
                      "ramp_s": trace.ramp_s, "phases": [p.name for p in trace.phases]},
            "startup_s": spec.startup_s, "placement": args.policy, **result}


WORKLOADS = ("chat", "long_prompt", "long_output")  # the shifting-mix trace's phases (pdserve.sim.shift)


def plan_main(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.bench.placement import h100_8b_profile
    from pdserve.sim.plan import PlanSpec, plan_cluster, synthetic_lengths, trace_lengths
    from pdserve.sim.scenario import load_profile
    from pdserve.sim.shift import DEFAULT_PHASES
    from pdserve.sim.workload import load_trace

    profile = load_profile(args.profile) if args.profile else h100_8b_profile()
    spec = PlanSpec(gpus=args.gpus, unit_gpus=args.unit_gpus, ttft_slo_s=args.ttft_ms / 1e3,
                    tpot_slo_s=args.tpot_ms / 1e3, window_s=args.window_s, policy=args.policy, seed=args.seed,
                    kv_part_tokens=args.kv_part_tokens or None)
    if args.trace:
        lengths, source = trace_lengths(load_trace(args.trace)), args.trace
    else:
        phase = next(p for p in DEFAULT_PHASES if p.name == args.workload)
        lengths, source = synthetic_lengths(phase.prompt, phase.output), f"{phase.name}: {phase.prompt} / {phase.output}"
    result = plan_cluster(profile, lengths, spec)
    d, c = result["disaggregated"], result["colocated"]
    return {"command": "python -m pdserve.sim " + " ".join(sys.argv[1:]),
            "profile": args.profile or "h100_8b_profile (pdserve.bench.placement)", "workload": source, **result,
            "disaggregated_vs_colocated_per_gpu": d["goodput_per_gpu"] / c["goodput_per_gpu"]
            if c["goodput_per_gpu"] else None}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.sim", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("scenario", help="a load-test scenario YAML at its sweep rates")
    s.add_argument("file", type=Path)
    s.add_argument("--profile", help="latency profile (default: the scenario's machine_profile or router profile)")
    s.add_argument("--rates", help="rates to simulate instead of the sweep grid, comma-separated")
    s.add_argument("--requests", type=int, help="requests per rate instead of the scenario's load.num_requests")
    t = sub.add_parser("trace", help="a JSONL trace (Mooncake fields) replayed on one cluster shape")
    t.add_argument("file")
    t.add_argument("--profile", required=True)
    t.add_argument("--trace-block-size", type=int, help="tokens per hash id (Mooncake: 512): prompts share "
                   "prefixes by their hash ids; default: no prefix sharing")
    t.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    t.add_argument("--prefill", type=int, default=1)
    t.add_argument("--decode", type=int, default=1)
    t.add_argument("--routers", type=int, default=1)
    t.add_argument("--policy", default="least_loaded")
    t.add_argument("--max-num-batched-tokens", type=int, default=2048)
    t.add_argument("--no-chunking", action="store_true")
    t.add_argument("--rate-scale", type=float, default=1.0, help="arrivals this many times faster")
    t.add_argument("--ttft-ms", type=float, default=2000.0)
    t.add_argument("--tpot-ms", type=float, default=200.0)
    t.add_argument("--per-request", action="store_true", help="every request's times in the output")
    a = sub.add_parser("autoscale", help="the 2-hour shifting-mix trace under the SLO-driven autoscaler")
    a.add_argument("--profile", help="latency profile (default: the H100 8B roofline profile)")
    a.add_argument("--duration-s", type=float, default=7200.0)
    a.add_argument("--rate", type=float, default=20.0, help="mean requests/s")
    a.add_argument("--window-s", type=float, default=600.0)
    a.add_argument("--ttft-ms", type=float, default=1000.0)
    a.add_argument("--tpot-ms", type=float, default=50.0)
    a.add_argument("--startup-s", type=float, default=60.0, help="a new replica serves this long after it is asked for")
    a.add_argument("--num-blocks", type=int, default=29205, help="KV blocks per replica (8B bf16 on 80 GiB)")
    a.add_argument("--max-replicas", type=int, default=32)
    a.add_argument("--policy", default="least_loaded", help="placement policy")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--no-static", action="store_true", help="skip simulating the static peak cluster")
    a.add_argument("--search-static", action="store_true",
                   help="also find the smallest static cluster meeting 0.9 in every window (several more runs)")
    pl = sub.add_parser("plan", help="replicas per role (disaggregated) and colocated at a GPU budget, routers, "
                        "Redis, and each shape's simulated goodput")
    pl.add_argument("--profile", help="latency profile of one GPU (default: the H100 8B roofline profile)")
    pl.add_argument("--workload", choices=WORKLOADS, default="chat", help="lengths of a built-in mix")
    pl.add_argument("--trace", help="JSONL trace (Mooncake fields) whose lengths replace --workload's")
    pl.add_argument("--gpus", type=int, default=1000)
    pl.add_argument("--unit-gpus", type=int, default=8, help="GPUs in the simulated unit the budget replicates")
    pl.add_argument("--ttft-ms", type=float, default=1000.0)
    pl.add_argument("--tpot-ms", type=float, default=50.0)
    pl.add_argument("--window-s", type=float, default=30.0, help="seconds of arrivals simulated per rate")
    pl.add_argument("--policy", default="least_loaded", help="placement policy")
    pl.add_argument("--kv-part-tokens", type=int, default=256,
                    help="the router's kv_part_tokens: a longer prompt is prefilled in chunks of this many tokens, "
                         "its KV handed over in parts (0: whole, after the prefill)")
    pl.add_argument("--seed", type=int, default=0)
    for sp in (s, t, a, pl):
        sp.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    run = {"scenario": scenario_main, "trace": trace_main, "autoscale": autoscale_main, "plan": plan_main}[args.command]
    try:
        result = run(args)
    except (ValueError, KeyError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"pdserve.sim: {message}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0
