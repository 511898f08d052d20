"""`pdserve-loadtest`: `run` (one load point against a URL), `sweep` (goodput of a URL), `scenario` (a YAML file),
`soak` (faults and bad input under load), `bound` (what placement can save at most on a scenario's trace),
`simulate` (a scenario through the discrete-event model, pdserve.sim: no server), `validate` (the simulator
against a scenario's committed live report), `ratio` (one target's goodput over another's across repeated
live runs, with its interval), `prefill-bound` (the most goodput a disaggregated target's prefill pool allows,
against its live runs)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

CORE_SHARING = ("step", "continuous", "auto")  # validation_model.CORE_SHARING_CHOICES (not imported: the CLI starts light)
SERVING_COSTS = ("counters", "step", "relay")
WAKE_WAIT = ("measured", "off")  # pdserve.loadtest.validation_model: the counters' wake-up wait, or none  # pdserve.loadtest.validate: the serving layer's decode time, per step or per row
POLL_PHASES = 8  # pdserve.loadtest.validation_model.POLL_PHASES
MID_STEP_ARRIVALS = ("report", "counted", "unseen")  # pdserve.loadtest.validation_model.MID_STEP_ARRIVALS
KV_PARTS = ("report", "on", "off")  # pdserve.loadtest.validation_model.KV_PARTS_CHOICES
CALIBRATE_ON = ("lowest", "each")  # pdserve.loadtest.validate.CALIBRATE_ON


def length_spec(text: str) -> int | dict[str, Any]:
    """'128' or 'lognormal:mean=1500,std=500,min=64,max=3500' / 'uniform:low=1,high=9'."""
    if text.isdigit():
        return int(text)
    kind, _, params = text.partition(":")
    spec: dict[str, Any] = {"dist": kind}
    for item in filter(None, params.split(",")):
        key, _, value = item.partition("=")
        spec[key.strip()] = float(value) if "." in value else int(value)
    return spec


def _workload_spec(args: argparse.Namespace) -> dict[str, Any]:
    if args.workload:
        import yaml

        return yaml.safe_load(Path(args.workload).read_text(encoding="utf-8"))
    if args.sharegpt:
        return {"kind": "sharegpt", "path": args.sharegpt}
    if args.mooncake:
        return {"kind": "mooncake", "path": args.mooncake}
    return {"kind": "synthetic", "prompt": length_spec(args.prompt_len), "output": length_spec(args.output_len)}


def _target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only by default)")
    p.add_argument("--allow-remote", action="store_true", help="allow a --url whose host is not loopback")
    p.add_argument("--model", default="tiny", help="tokenizer source: 'tiny' or the checkpoint directory served")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", help="YAML file with a workload mapping (kind: synthetic|sharegpt|mooncake, ...)")
    w.add_argument("--sharegpt", help="ShareGPT-format JSON file")
    w.add_argument("--mooncake", help="Mooncake trace JSONL file")
    w.add_argument("--prompt-len", default="256", help="synthetic prompt lengths, e.g. 256 or lognormal:mean=1500,std=500")
    w.add_argument("--output-len", default="64", help="synthetic output lengths")
    ld = p.add_argument_group("load")
    ld.add_argument("-n", "--num-requests", type=int, default=100)
    ld.add_argument("--max-duration", type=float, default=300.0, help="wall-clock bound of each run (s)")
    ld.add_argument("--arrival", default="poisson", choices=["poisson", "gamma", "constant", "trace"])
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    ld.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("SLO")
    s.add_argument("--slo-ttft-ms", type=float)
    s.add_argument("--slo-tpot-ms", type=float)
    s.add_argument("--slo-ttft-factor", type=float, help="x the target's idle TTFT (measured first)")
    s.add_argument("--slo-tpot-factor", type=float, help="x the target's idle TPOT")
    p.add_argument("--out", type=Path, help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (also off when not a TTY)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve-loadtest", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one load point against a running server")
    _target_args(run)
    mode = run.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=float, help="open loop: mean requests/s, default 1 ('inf': all at once)")
    mode.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    sweep = sub.add_parser("sweep", help="goodput of a running server by a rate sweep with bisection")
    _target_args(sweep)
    sweep.add_argument("--rates", default="0.5,1,2", help="grid of rates (req/s), comma-separated, ascending")
    sweep.add_argument("--max-runs", type=int, default=6)
    sweep.add_argument("--rel-tol", type=float, default=0.1)
    sweep.add_argument("--name", default="target", help="the target's name in the report")
    scenario = sub.add_parser("scenario", help="deploy each target of a YAML scenario on a local Ray and compare")
    scenario.add_argument("file", type=Path)
    scenario.add_argument("--out", type=Path, required=True)
    scenario.add_argument("--port", type=int, default=0, help="Serve HTTP port when Serve is started here")
    scenario.add_argument("--no-progress", action="store_true")
    bound = sub.add_parser("bound", help="a Mooncake-trace scenario's prefix hit rate and model time per request: "
                           "the ceiling of any placement against a cache-blind one (no server)")
    bound.add_argument("file", type=Path)
    bound.add_argument("--batches", default="1,2,4,16", help="decode batch sizes to price a request's decode at")
    bound.add_argument("--draws", type=int, default=200, help="random placements averaged for the cache-blind case")
    simulate = sub.add_parser("simulate", help="a scenario through the simulator (pdserve.sim) at its sweep rates")
    simulate.add_argument("file", type=Path)
    simulate.add_argument("--profile", help="latency profile (default: the scenario's machine_profile)")
    simulate.add_argument("--rates", help="rates instead of the sweep grid, comma-separated")
    simulate.add_argument("--requests", type=int, help="requests per rate instead of load.num_requests")
    simulate.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    validate = sub.add_parser("validate", help="the simulator against committed live reports: predicted beside "
                              "measured TTFT/TPOT p50/p90 per point and goodput per target (no server)")
    validate.add_argument("scenarios", nargs="+", metavar="SCENARIO",
                          help="a scenario YAML or a committed scenario's name (router-policies, ...)")
    validate.add_argument("--report", action="append", help="a live report; repeat it for repeated runs, "
                          "combined per figure (default loadtest/results/<name>/run-*/summary.json, else "
                          "loadtest/results/<name>/summary.json)")
    validate.add_argument("--all-runs", action="store_true",
                          help="every set of repeated runs under loadtest/results/<name> (run-*/summary.json at "
                          "any depth), pooled: each run simulated with its own calibration and its code's features")
    validate.add_argument("--profile", help="latency profile (default: the one the report's run named)")
    validate.add_argument("--write", nargs="?", type=Path, const=Path("loadtest/results/simulator-validation.json"),
                          help="also merge the result into this file (default path: %(const)s)")
    validate.add_argument("--serving-cores", type=float, default=0.0, metavar="CORES",
                          help="what-if: cores the serving layer outside the replicas (Serve proxy, load client, "
                          "Ray's processes) kept busy on the report's host, taken from its cores in the model "
                          "(the reports do not measure it; default %(default)s)")
    validate.add_argument("--replica-threads", type=int, default=None, metavar="N",
                          help="what-if: each report's machine check (run at the host's default threads) scaled "
                          "to N threads a replica, by the check's shapes measured here at N and at the default "
                          "(pdserve.loadtest.machine_threads; a few minutes)")
    validate.add_argument("--serving-cost", choices=SERVING_COSTS, default=SERVING_COSTS[0],
                          help="how the serving layer's decode time is calibrated: from the engines' own step "
                          "counters at each target's lowest rate (the gaps between steps, and the steps' CPU; "
                          "reports without counters fall back to step), per step from each target's batch probe "
                          "(reports without one fall back to relay), or per row from its idle probe's TPOT, the "
                          "calibration before the batch probe (default %(default)s)")
    validate.add_argument("--core-sharing", choices=CORE_SHARING, default="auto",
                          help="how the model's steps share the host's cores: each slowed by the demand when it "
                          "starts, or all re-rated whenever a step starts or ends, or auto: continuous for targets "
                          "whose step counters measure the wake-up wait, step elsewhere (default %(default)s)")
    validate.add_argument("--poll-phases", type=int, default=POLL_PHASES, metavar="N",
                          help="each prediction is the median of N simulations whose routers poll at phases "
                          "spread over the poll period, as a live run's fall anywhere against its arrivals "
                          "(1 with round_robin, which reads no stats; default %(default)s)")
    validate.add_argument("--contention", action="store_true",
                          help="what-if: where a target ran more one-thread engines than its host had cores, "
                          "measure here how much such engines slow beyond a fair share of the cores, for a "
                          "prefill and a decode step, and model it (pdserve.loadtest.contention; ~1 min); "
                          "without it, a report that measured its own (runs since 2026-12-02) is modelled with that. It scales "
                          "step sharing only: targets shared continuously (--core-sharing auto, where the step "
                          "counters measure the wait) keep their fair share")
    validate.add_argument("--noise-ceiling", action="store_true",
                          help="also the chance that an exact model meets the ±20%% target against runs like "
                               "these, the poll phase being their only noise (pdserve.loadtest.validation_ceiling)")
    validate.add_argument("--mid-step-arrivals", choices=MID_STEP_ARRIVALS, default=MID_STEP_ARRIVALS[0],
                          help="whether the engines' stats showed a request waiting for a step in flight: as the "
                               "report's code did (default), or a what-if either way")
    validate.add_argument("--kv-parts", choices=KV_PARTS, default=KV_PARTS[0],
                          help="whether the router handed long prompts' KV to decode in parts while they were "
                               "prefilled (kv_part_tokens): as the report's code did (default), or a what-if")
    validate.add_argument("--wake-wait", choices=WAKE_WAIT, default=WAKE_WAIT[0],
                          help="with step counters: a woken step thread's wait for a busy host's cores, as the "
                               "counters measured it in the gaps between steps, or a what-if without it")
    validate.add_argument("--speed-sensitivity", action="store_true",
                          help="also each figure's elasticity to the replicas' speed, the speed error that moves it "
                               "by 20%%, and how far the engines' step counters put each point's speed from the "
                               "lowest rate's (pdserve.loadtest.validation_sensitivity)")
    validate.add_argument("--replication", action="store_true",
                          help="also, per set of repeated runs (the directory holding run-*/), the model's score "
                               "against its median measurements beside the other sets' measurements' score: the "
                               "live experiment repeated as a prediction (pdserve.loadtest.validation_replication)")
    validate.add_argument("--calibrate-on", choices=CALIBRATE_ON, default=CALIBRATE_ON[0],
                          help="each point simulated with the calibration at its target's lowest rate (a "
                               "prediction), or, as a what-if, with one from that point's own measurements: the "
                               "model's structure apart from how its terms move with the load (default %(default)s)")
    validate.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    ratio = sub.add_parser("ratio", help="one target's goodput over the others' across a scenario's repeated "
                           "live runs: per run, pooled, and a 90%% interval (pdserve.loadtest.goodput_ratio)")
    ratio.add_argument("results", type=Path, help="a results directory: run-*/summary.json, else summary.json")
    ratio.add_argument("--target", help="numerator (default: the reports' SLO reference target)")
    ratio.add_argument("--baseline", action="append", help="denominator; repeat it (default: every other target)")
    ratio.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    pb = sub.add_parser("prefill-bound", help="the most goodput a disaggregated target's prefill pool allows "
                        "(FIFO at its machine check's idle speed, no decode), against its live reports' goodputs")
    pb.add_argument("results", type=Path, help="a results directory: run-*/summary.json, else summary.json")
    pb.add_argument("--target", help="the disaggregated target (default: the reports' first)")
    pb.add_argument("--steady-requests", type=int, default=500, help="requests per draw of the steady reading")
    pb.add_argument("--draws", type=int, default=20, help="seeded draws of the steady reading")
    pb.add_argument("--rates", help="the steady reading's rates, comma-separated (default: the grid, then up to "
                    "twice its top)")
    pb.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    from pdserve.loadtest.soak import add_soak_args

    add_soak_args(sub.add_parser("soak", help="N requests with disconnects, bad inputs and replica kills; "
                                 "every request accounted for, no KV leak, bounded RSS (exit 1 otherwise)"))
    return p


def _slo_spec(args: argparse.Namespace):
    from pdserve.loadtest.slo import SLOSpec

    fields = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms,
              "ttft_factor": args.slo_ttft_factor, "tpot_factor": args.slo_tpot_factor}
    given = {k: v for k, v in fields.items() if v is not None}
    return SLOSpec.from_dict(given) if given else None


def _setup(args: argparse.Namespace):
    import asyncio

    from pdserve.loadtest.client import new_client, served_model
    from pdserve.loadtest.runner import LoadConfig
    from pdserve.loadtest.targets import check_url
    from pdserve.loadtest.workloads import TokenSource, workload

    url = check_url(args.url, args.allow_remote)

    async def name() -> str:
        async with new_client(1) as client:
            return await served_model(client, url)

    load = LoadConfig(args.num_requests, args.max_duration, args.arrival, args.burstiness, args.seed)
    return url, asyncio.run(name()), TokenSource.for_model(args.model), workload(_workload_spec(args)), load


def run_main(args: argparse.Namespace) -> int:
    from pdserve.loadtest.evaluate import measure_idle
    from pdserve.loadtest.runner import run_point
    from pdserve.loadtest.slo import attainment, request_goodput

    url, name, tokens, work, load = _setup(args)
    rate = None if args.concurrency else (args.rate if args.rate is not None else 1.0)
    spec = _slo_spec(args)
    idle = measure_idle(url, name, tokens, work) if spec is not None and spec.needs_reference else None
    run = run_point(url, name, tokens, work, load, rate=rate, concurrency=args.concurrency,
                    progress=False if args.no_progress else None)
    record: dict[str, Any] = {"url": url, "model": name, **run.to_dict()}
    if spec is not None:
        slo = spec.resolve(idle)
        record.update(slo=slo.to_dict(), attainment=attainment(run.results, slo),
                      goodput=request_goodput(run.results, slo, run.duration_s))
    print(json.dumps({k: v for k, v in record.items() if k != "requests"}, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "run.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return 0


def sweep_main(args: argparse.Namespace) -> int:
    from pdserve.loadtest.evaluate import measure_idle, sweep_target
    from pdserve.loadtest.report import write_report
    from pdserve.loadtest.sweep import SweepConfig

    spec = _slo_spec(args)
    if spec is None or args.out is None:
        print("sweep needs an SLO (--slo-ttft-ms/--slo-ttft-factor and --slo-tpot-ms/--slo-tpot-factor) and --out",
              file=sys.stderr)
        return 2
    url, name, tokens, work, load = _setup(args)
    config = SweepConfig(tuple(float(r) for r in args.rates.split(",")), args.max_runs, args.rel_tol)
    idle = measure_idle(url, name, tokens, work)
    slo = spec.resolve(idle)
    args.out.mkdir(parents=True, exist_ok=True)
    result = sweep_target(args.name, url, name, tokens, work, load, config, slo, args.out, idle=idle,
                          progress=False if args.no_progress else None, log=lambda m: print(m, file=sys.stderr))
    from pdserve.loadtest.provenance import provenance

    meta = {"scenario": f"sweep of {url}", "model": name, "workload": _workload_spec(args),
            "slo_spec": spec.__dict__, "slo_reference": args.name, "provenance": provenance()}
    summary = write_report(args.out, [result], slo, config.rates[len(config.rates) // 2], config.target, meta)
    target = summary["targets"][0]
    print(json.dumps({"goodput": target["goodput"], "goodput_capped": target["goodput_capped"],
                      "slo": summary["slo"]}, indent=1))
    return 0


def scenario_main(args: argparse.Namespace) -> int:
    from pdserve.loadtest.scenario import Scenario, run_scenario

    summary = run_scenario(Scenario.from_yaml(args.file), args.out, progress=False if args.no_progress else None,
                           log=lambda m: print(m, file=sys.stderr, flush=True), port=args.port)
    print(json.dumps(summary["comparison"], indent=1))
    print(f"wrote {args.out / 'summary.md'}", file=sys.stderr)
    return 0


def bound_main(args: argparse.Namespace) -> int:
    from pdserve.loadtest.placement_bound import scenario_bound
    from pdserve.loadtest.scenario import Scenario

    batches = tuple(int(b) for b in args.batches.split(","))
    print(json.dumps(scenario_bound(Scenario.from_yaml(args.file), batches, args.draws), indent=1))
    return 0


def simulate_main(args: argparse.Namespace) -> int:
    from pdserve.sim.cli import scenario_main as simulate_scenario

    args.prog = "pdserve-loadtest"
    print(json.dumps(simulate_scenario(args)))
    return 0


def validate_main(args: argparse.Namespace) -> int:
    from pdserve.loadtest.validation_runs import validate_main as validate

    print(json.dumps(validate(args.scenarios, args.report, args.profile, args.write, args.serving_cores,
                              args.replica_threads, args.serving_cost, args.core_sharing,
                              args.poll_phases, args.contention, args.noise_ceiling, args.mid_step_arrivals,
                              args.wake_wait, args.kv_parts, args.all_runs, args.calibrate_on,
                              args.speed_sensitivity, replication=args.replication)))
    return 0


def ratio_main(args: argparse.Namespace) -> int:
    from pdserve.loadtest.goodput_ratio import ratio_main as ratios

    print(json.dumps(ratios(args.results, args.target, args.baseline)))
    return 0


def prefill_bound_main(args: argparse.Namespace) -> int:
    from pdserve.loadtest.prefill_bound import prefill_bound_main as bound

    rates = [float(r) for r in args.rates.split(",")] if args.rates else None
    print(json.dumps(bound(args.results, args.target, args.steady_requests, args.draws, rates)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "soak":
            from pdserve.loadtest.soak_run import soak_main

            return soak_main(args)
        return {"run": run_main, "sweep": sweep_main, "scenario": scenario_main, "bound": bound_main,
                "simulate": simulate_main, "validate": validate_main, "ratio": ratio_main,
                "prefill-bound": prefill_bound_main}[args.command](args)
    except ValueError as exc:
        print(f"pdserve-loadtest: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
