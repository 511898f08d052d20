"""The soak end to end: deploy (as scenarios do), warm up, baseline RSS and counters, the load with its two
kills, then quiescence, leaks and RSS; summary.json and summary.md in the output directory."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from pdserve.loadtest import soak_system as sys_
from pdserve.loadtest.provenance import header_line, provenance
from pdserve.loadtest.soak import SoakConfig, drive, plan, tally

COUNTERS = (("pdserve_migrations", "reason"), ("pdserve_fallbacks", "reason"), ("pdserve_router_requests", "status"))


def _counters(url: str) -> dict[str, dict[str, float]]:
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        samples = sys_.scrape(client, url)
    return {name: sys_.counter_total(samples, name, by) for name, by in COUNTERS}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def _rss_report(start: dict[int, dict[str, Any]], end: dict[int, dict[str, Any]], kills: list[sys_.Kill],
                bound: float, samples: list[dict[str, Any]]) -> dict[str, Any]:
    mib = 1 / (1 << 20)
    survivors, killed, restarted = [], [], []
    half = [x for x in samples if x["t_s"] >= samples[-1]["t_s"] / 2][:1] if samples else []
    for pid, s in sorted(start.items()):
        if pid in end:
            growth = end[pid]["rss_bytes"] / s["rss_bytes"] - 1
            mid = half[0]["rss"].get(pid) if half else None
            survivors.append({"pid": pid, "role": s["role"], "start_mib": round(s["rss_bytes"] * mib, 1),
                              "end_mib": round(end[pid]["rss_bytes"] * mib, 1), "growth": round(growth, 4),
                              "growth_second_half": round(end[pid]["rss_bytes"] / mid - 1, 4) if mid else None,
                              "within_bound": growth <= bound,
                              "trace_mib": [[x["t_s"], round(x["rss"][pid] * mib, 1)] for x in samples
                                            if pid in x["rss"]]})
        else:
            killed.append({"pid": pid, "role": s["role"], "start_mib": round(s["rss_bytes"] * mib, 1)})
    first_seen = {k.new_pid: k.replacement_rss_bytes for k in kills if k.new_pid}
    for pid, e in sorted(end.items()):
        if pid not in start:
            seen = first_seen.get(pid)
            restarted.append({"pid": pid, "role": e["role"], "end_mib": round(e["rss_bytes"] * mib, 1),
                              "first_seen_mib": round(seen * mib, 1) if seen else None})
    return {"bound": bound, "replicas": survivors, "killed": killed, "restarted": restarted,
            "exceeded": [r["pid"] for r in survivors if not r["within_bound"]]}


def run_soak(config: SoakConfig, model_spec: Any, out_dir: Path, *, port: int = 0,
             log: Callable[[str], None] = print) -> tuple[dict[str, Any], int]:
    from pdserve.loadtest.arrivals import arrival_process
    from pdserve.loadtest.client import new_client, served_model
    from pdserve.loadtest.models import resolve_model
    from pdserve.loadtest.targets import deployed, local_serve
    from pdserve.loadtest.workloads import TokenSource, workload

    out_dir.mkdir(parents=True, exist_ok=True)
    model = resolve_model(model_spec)
    tokens = TokenSource.for_model(model)
    n, w = config.num_requests, config.warmup_requests
    specs = workload({"kind": "synthetic", "prompt": config.prompt, "output": config.output}).requests(
        tokens, n + w, config.seed)
    schedule = arrival_process("poisson", config.rate).schedule(n, config.seed)
    deadline = config.max_duration_s or 2 * schedule[-1] + 120
    app = f"soak-{os.getpid()}"  # process titles carry it: never another session's replicas
    kills = [sys_.Kill("prefill", 0.3 * schedule[-1]), sys_.Kill("decode", 0.6 * schedule[-1])] if config.kill else []
    started = time.monotonic()
    uptime_before = Path("/proc/loadavg").read_text().split()[:3]
    with local_serve({"num_cpus": 4}, port) as local, \
            deployed(local, config.system(model), app, f"/{app}", 180.0) as url:
        async def name() -> str:
            async with new_client(1) as client:
                return await served_model(client, url)

        served = asyncio.run(name())
        log(f"[soak] {app} up at {url}; warm-up: {w} requests")
        warm_schedule = [i / config.rate for i in range(w)]
        warm, _ = asyncio.run(drive(url, served, specs[n:], ["valid"] * w, warm_schedule, 60.0 + 2 * w,
                                    config.seed, [], app, config, log))
        warm_tally = tally(warm, specs[n:], [])
        rss_start, before = sys_.snapshot_rss(app), _counters(url)
        kinds = plan(config, n, config.seed)
        log(f"[soak] {n} requests at {config.rate:g} req/s (~{schedule[-1]:.0f} s); kills at "
            + ", ".join(f"{k.role} t={k.at_s:.0f}s" for k in kills))
        rss_samples: list[dict[str, Any]] = []
        outcomes, duration = asyncio.run(drive(url, served, specs[:n], kinds, schedule, deadline, config.seed,
                                               kills, app, config, log, rss_samples))
        windows = [win for k in kills if (win := k.window(config.kill_grace_s, duration))]
        result = tally(outcomes, specs[:n], windows)
        num_workers = config.prefill_replicas + config.decode_replicas
        series, quiet_s = sys_.wait_quiescent(url, num_workers, config.quiescence_bound_s)
        rss_end, after = sys_.snapshot_rss(app), _counters(url)
    leaked = [s for s in series if s["value"]]
    replicas = sys_.worker_replicas(series)
    rss = _rss_report(rss_start, rss_end, kills, config.rss_growth_bound, rss_samples)
    deltas = {name: _delta(after[name], before[name]) for name, _ in COUNTERS}
    summary = {
        "config": {**asdict(config), "model": str(model_spec), "served_model": served},
        "duration_s": round(duration, 1), "achieved_rate": round(n / duration, 2),
        "loadavg_before": uptime_before, "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        **result,
        "warmup": warm_tally["accounting"],
        "migrated": sum(deltas["pdserve_migrations"].values()),
        "counters_delta": deltas,
        "kills": [k.to_dict() for k in kills], "kill_windows_s": [[round(a, 1), round(b, 1)] for a, b in windows],
        "leaks": {"quiescent_after_s": None if quiet_s is None else round(quiet_s, 2), "replicas_seen": len(replicas),
                  "nonzero_series": leaked, "series": series},
        "rss": rss,
        "wall_time_s": round(time.monotonic() - started, 1),
        "provenance": provenance(),
    }
    checks = {"unaccounted": result["accounting"]["unaccounted"] + warm_tally["accounting"]["unaccounted"],
              "leaks": len(leaked) + (0 if quiet_s is not None and len(replicas) == num_workers else 1),
              "rss_exceeded": len(rss["exceeded"]),
              "kills_done": all(k.killed_s is not None for k in kills)}
    summary["checks"] = checks
    summary["passed"] = not (checks["unaccounted"] or checks["leaks"] or checks["rss_exceeded"]) \
        and checks["kills_done"]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    (out_dir / "summary.md").write_text(markdown(summary), encoding="utf-8")
    return summary, 0 if summary["passed"] else 1


def markdown(s: dict[str, Any]) -> str:
    c, a = s["config"], s["accounting"]
    lines = [f"# Soak: {a['total']} requests at {c['rate']:g} req/s ({'PASSED' if s['passed'] else 'FAILED'})", "",
             header_line(s.get("provenance")), "",
             f"Model `{c['model']}`, {c['prefill_replicas']} prefill + {c['decode_replicas']} decode replicas (UCX), "
             f"{s['duration_s']} s ({s['achieved_rate']} req/s achieved); load average "
             f"{' '.join(s['loadavg_before'])} before, {' '.join(s['loadavg_after'])} after.", "",
             "| completed | failed clean | bad input rejected 4xx | disconnected (planned) | migrated | unaccounted |",
             "|---|---|---|---|---|---|",
             f"| {a['completed']} | {a['failed_clean']} | {a['rejected_bad_input']} | {a['disconnected']} "
             f"| {s['migrated']:g} | {a['unaccounted']} |", "",
             f"Kills: " + "; ".join(f"{k['role']} pid {k['pid']} at {k['killed_s']:.1f} s, replaced by pid "
                                    f"{k['new_pid']} at {k['replaced_s'] or float('nan'):.1f} s"
                                    for k in s["kills"] if k["killed_s"] is not None), "",
             f"Counters (delta): `{json.dumps(s['counters_delta'])}`", "",
             "Rules: completed = 200, exactly max_tokens tokens, [DONE]. Failed clean = an OpenAI error body "
             "(HTTP or an SSE error event then [DONE]): 429/503 any time, other 5xx only overlapping a kill window "
             f"(kill -> replacement seen + {c['kill_grace_s']:g} s). Bad inputs must get 4xx with an OpenAI error "
             "body. Anything else (a stream without [DONE], a short stream, a 5xx outside a window, a request open "
             "at the deadline) is unaccounted. Migrated streams count as their client saw them; `migrated` is the "
             "router's pdserve_migrations_total delta.", "",
             f"Leaks: {len(s['leaks']['nonzero_series'])} non-zero KV lease/usage series over "
             f"{s['leaks']['replicas_seen']} prefill and decode replicas, quiescent after "
             f"{s['leaks']['quiescent_after_s']} s.", "",
             f"RSS (bound: +{s['rss']['bound']:.0%} from after warm-up to the end, per replica; 2nd half: from the "
             "sample nearest mid-run):", "",
             "| role | pid | start MiB | end MiB | growth | growth, 2nd half |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['role']} | {r['pid']} | {r['start_mib']} | {r['end_mib']} | {r['growth']:+.1%} | "
              + (f"{r['growth_second_half']:+.1%} |" if r["growth_second_half"] is not None else "- |")
              for r in s["rss"]["replicas"]]
    lines += [f"| {r['role']} (restarted) | {r['pid']} | {r['first_seen_mib']} (first seen) | {r['end_mib']} | - | - |"
              for r in s["rss"]["restarted"]]
    return "\n".join(lines) + "\n"


def soak_main(args: Any) -> int:
    import sys

    config = SoakConfig(num_requests=args.num_requests, rate=args.rate, seed=args.seed,
                        disconnect_fraction=args.disconnect_fraction, bad_fraction=args.bad_fraction,
                        kill=not args.no_kill, prefill_replicas=args.prefill_replicas,
                        decode_replicas=args.decode_replicas, warmup_requests=args.warmup,
                        quiescence_bound_s=args.quiescence_bound, rss_growth_bound=args.rss_growth_bound,
                        max_duration_s=args.max_duration)
    summary, code = run_soak(config, args.model, args.out, port=args.port,
                             log=lambda m: print(m, file=sys.stderr, flush=True))
    leaks = {k: v for k, v in summary["leaks"].items() if k != "series"}  # every series is in summary.json
    print(json.dumps({**summary, "leaks": leaks}, indent=1))
    print(f"wrote {args.out / 'summary.json'}", file=sys.stderr)
    return code
