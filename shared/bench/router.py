"""`pdserve bench router`: what the router and the KV handoff add over a direct engine call.

The same requests (a fixed token prompt, greedy, exact output length) go straight into an
in-process AsyncLLMEngine and over HTTP through the Serve app, alternating request by request so
both share the machine's drift: disaggregated (every request takes the prefill pool and a KV
handoff) and colocated (router + one engine), each deployed alone beside the direct engine. TTFT is
the first streamed token (delta or SSE chunk), E2E the last, TPOT (E2E - TTFT) / (tokens - 1); the
differences and ratios are what serving adds. Messages per token counts stream items (engine deltas
or SSE chunks with a choice) per generated token. Each path's summary also has the step time of the
engine that served it (`step_ms_p50`: the direct engine, or the app's decode replica) and what TPOT
spends beyond it (`between_steps_ms`), so a routed token's extra cost shows as slower steps or as
more time between them. After each app's load, `idle_replica_cpu_pct` is what its replicas burn for
5 s with nothing in flight (the router's stats polls and the workers' answers, transport threads).
With `--poll-dashboard HZ`, every routed app's /dashboard/data is fetched HZ times a second throughout
(`dashboard_polls`: how many, and what one took), so the figures can be set beside a run without, and
each app's quiet interval is measured again while polled (`idle_replica_cpu_pct_dashboard_polled`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import sys
import time
from typing import Any

from pdserve.registry import load
from pdserve.bench.router_clients import alternating, direct_one, http_one, levels
from pdserve.bench.idle import idle_cpu_pct
from pdserve.bench.steps import StepTimes, engine_steps, replica_steps

# what it measures, by import path (as a Serve config names it): the library imports no service
SERVICES = {"system": "pdserve.services.app:build_system", "worker": "pdserve.services.worker:WorkerConfig"}

PATHS = ("disaggregated", "colocated")
TRACED = "disaggregated_traced"
IDLE, IDLE_SECONDS = "idle_replica_cpu_pct", 5.0
DASHBOARD, POLLED_IDLE = "dashboard_polls", "idle_replica_cpu_pct_dashboard_polled"


def _log(message: str) -> None:
    print(f"[bench router] {message}", file=sys.stderr, flush=True)


async def poll_dashboards(urls: list[str], hz: float, stop: asyncio.Event) -> dict[str, Any] | None:
    """GET {url}/dashboard/data of every url, `hz` rounds a second, until `stop`: the answers, the failures
    and what one took (ms). None when hz is 0."""
    if hz <= 0:
        return None
    import httpx
    import numpy as np

    took: list[float] = []
    failed = 0

    async def one(client: httpx.AsyncClient, url: str) -> None:
        nonlocal failed
        start = time.perf_counter()
        try:
            (await client.get(f"{url}/dashboard/data")).raise_for_status()
        except httpx.HTTPError:
            failed += 1
            return
        took.append(time.perf_counter() - start)

    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            next_round = time.perf_counter() + 1 / hz
            await asyncio.gather(*(one(client, url) for url in urls))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, next_round - time.perf_counter()))
    ms = np.array(took or [float("nan")]) * 1e3
    return {"hz": hz, "polls": len(took), "failed": failed, "ms_p50": round(float(np.percentile(ms, 50)), 3),
            "ms_p99": round(float(np.percentile(ms, 99)), 3)}


async def _polled_idle(urls: dict[str, str], hz: float) -> dict[str, dict[str, float]]:
    """Each app's quiet interval again with its dashboard polled: what polling alone burns, per replica."""
    out = {}
    for name, url in urls.items():
        stop = asyncio.Event()
        polls = asyncio.create_task(poll_dashboards([url], hz, stop))
        out[name] = await asyncio.to_thread(idle_cpu_pct, name, IDLE_SECONDS)
        stop.set()
        await polls
    return out


def _routed(
    prompts, concurrencies, num_requests, max_tokens, env: dict[str, str], tracing=None,
    streaming: dict[str, Any] | None = None, ingress: str = "direct", grpc_handles: bool = True,
    worker_niceness: int = 0, isolated: bool = False, model: str = "tiny", poll_dashboard_hz: float = 0.0,
) -> dict[str, dict[str, Any]]:
    import httpx
    import ray
    from ray import serve

    from pdserve.engine.async_engine import AsyncLLMEngine
    from pdserve.models.resolve import served_model_name
    from pdserve.runtime.redis_server import free_port
    from pdserve.runtime.serve_env import app_ports, serve_env

    build_system, worker_config = load(SERVICES, "system", "builder"), load(SERVICES, "worker", "config")

    port, direct_port = free_port(), free_port()
    ports = range(direct_port, direct_port + 3)  # direct ingress: a port per app deployed at once
    os.environ.update(serve_env(ingress, direct_port, None, grpc_handles, len(ports), worker_niceness))
    streaming = streaming or {}
    worker = {"num_cpus": 1, "num_blocks": 512, "model": model,
              **{k: v for k, v in streaming.items() if k != "worker_link"}}
    router_streaming = {k: v for k, v in streaming.items() if k in ("stream_coalesce", "stream_interval_ms",
                                                                     "worker_link")}
    ray.init(address="local", num_cpus=8, include_dashboard=False, configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": env} if env else None)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        results = {}
        # apps measured together, requests alternating between them; tracing on vs off side by side
        groups = [[("disaggregated", "disaggregated", {})], [("colocated", "colocated", {})]]
        if tracing is not None:
            groups[0].append((TRACED, "disaggregated", tracing()))
        for group in groups:
            for name, mode, traced in group:
                config = dict(model=model, mode=mode, transport="ucx", prefill=worker, decode=worker,
                              tracing_env=traced,
                              router={"disaggregate_min_prompt_tokens": 0, "num_cpus": 0.5, **router_streaming})
                serve.run(build_system(config), name=name, route_prefix=f"/{name}")
                _log(f"{name}: deployed")
            urls = {name: f"http://127.0.0.1:{port}/{name}" for name, _, _ in group}
            if ingress == "direct":
                found = app_ports("127.0.0.1", ports)
                urls = {name: f"http://127.0.0.1:{found[name]}/{name}" for name, _, _ in group}

            steps = StepTimes()

            async def run(group=group, urls=urls) -> list[dict[str, Any]]:
                engine = AsyncLLMEngine.from_config(worker_config(model=model, num_cpus=1).engine_config())
                stop = asyncio.Event()
                polls = asyncio.create_task(poll_dashboards(list(urls.values()), poll_dashboard_hz, stop))
                try:
                    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
                        ones = [steps.wrap("direct", direct_one(engine, max_tokens), engine_steps(engine))] + [
                            steps.wrap(name, http_one(client, urls[name], max_tokens, served_model_name(model)),
                                       replica_steps(_decode_handle(serve, name)))
                            for name, _, _ in group]
                        if isolated:  # each path alone on the machine, one after another
                            return [(await levels(o, prompts, concurrencies, num_requests, steps=steps))[0]
                                    for o in ones]
                        return await levels(alternating(ones), prompts, concurrencies, num_requests, len(ones),
                                             steps)
                finally:
                    stop.set()
                    results.setdefault(DASHBOARD, {})[group[0][0]] = await polls
                    await engine.close()

            direct, *routed = asyncio.run(run())
            results[f"direct@{group[0][0]}"] = direct
            for (name, _, _), summary in zip(group, routed):
                results[name] = summary
            for name, summaries in (("direct", direct), *((n, results[n]) for n, _, _ in group)):
                for c, summary in summaries.items():
                    summary.update(steps.summary(name, int(c), summary["tpot_ms_p50"]))
            time.sleep(1.0)  # the last streams' ends settle; the router's poller keeps running
            for name, _, _ in group:
                results.setdefault(IDLE, {})[name] = idle_cpu_pct(name, IDLE_SECONDS)
            if poll_dashboard_hz:
                results.setdefault(POLLED_IDLE, {}).update(asyncio.run(_polled_idle(urls, poll_dashboard_hz)))
            for name, _, _ in group:
                serve.delete(name)
        return results
    finally:
        serve.shutdown()
        ray.shutdown()


def _decode_handle(serve, app: str):
    """The app's decode deployment, its router on Serve's own loop thread whatever RAY_SERVE_RUN_ROUTER_IN_
    SEPARATE_LOOP says (pdserve serve sets it to 0 for its replicas): a router bound to this bench's
    `asyncio.run` loop would outlive the loop, and `serve.shutdown()` would then fail on the closed loop."""
    handle = serve.get_deployment_handle("decode", app_name=app)
    if not handle.is_initialized:
        handle._init(_run_router_in_separate_loop=True)
    return handle


def run(
    num_requests: int = 64, concurrencies: tuple[int, ...] = (1, 16), prompt_tokens: int = 16,
    max_tokens: int = 64, seed: int = 0, env: dict[str, str] | None = None, tracing: bool = False,
    streaming: dict[str, Any] | None = None, ingress: str = "direct", grpc_handles: bool = True,
    worker_niceness: int = 0, isolated: bool = False, model: str = "tiny", poll_dashboard_hz: float = 0.0,
) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(0, 256) for _ in range(prompt_tokens)] for _ in range(16)]
    sink: list = []  # started after Ray: a live gRPC server in this process breaks Ray's fork of its raylet
    if tracing:
        from pdserve.bench.tracing_cost import start_sink
    try:
        routed = _routed(prompts, list(concurrencies), num_requests, max_tokens, env or {},
                         (lambda: start_sink(sink)) if tracing else None, streaming, ingress, grpc_handles,
                         worker_niceness, isolated, model, poll_dashboard_hz)
    except BaseException:
        if sink:
            sink[0].stop(grace=None)
        raise
    sink_endpoint = f"http://127.0.0.1:{sink[1]}" if sink else ""
    result: dict[str, Any] = {
        "bench": "router", "model": model, "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "prompt_tokens": prompt_tokens, "output_tokens": max_tokens, "env": env or {},
        "streaming": streaming or {}, "ingress": ingress, "grpc_handles": grpc_handles,
        "worker_niceness": worker_niceness, "isolated": isolated, "poll_dashboard_hz": poll_dashboard_hz,
    }
    # each app's replicas with nothing in flight, after its load (stats polls, transport threads): % of one core
    result[IDLE] = routed.pop(IDLE, {})
    polled = routed.pop(DASHBOARD, {})  # by the first app of each group of apps measured together
    if poll_dashboard_hz:
        result[DASHBOARD] = polled
        result[POLLED_IDLE] = routed.pop(POLLED_IDLE)
    if sink:
        result["otlp_exports_received"] = sink[2]["exports"]
        result["otlp_bytes_received"] = sink[2]["bytes"]
    for c in concurrencies:
        key = str(c)
        block: dict[str, Any] = {"direct": routed["direct@disaggregated"][key],
                                 "direct_beside_colocated": routed["direct@colocated"][key],
                                 **{mode: routed[mode][key] for mode in PATHS}}
        for mode, prefix in (("disaggregated", "added"), ("colocated", "colocated_added")):
            direct = routed[f"direct@{mode}"][key]
            for metric in ("ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50", "e2e_ms_p99"):
                block[f"{prefix}_{metric}"] = round(routed[mode][key][metric] - direct[metric], 3)
            for metric in ("tpot_ms_p50", "e2e_ms_p50"):
                ratio = routed[mode][key][metric] / direct[metric] if direct[metric] else float("nan")
                block[f"{mode}_{metric.removesuffix('_ms_p50')}_ratio_p50"] = round(ratio, 4)
        if TRACED in routed:
            block[TRACED] = traced = routed[TRACED][key]
            base = routed["disaggregated"][key]
            for metric in ("ttft_ms_p50", "e2e_ms_p50"):
                block[f"tracing_added_{metric}"] = round(traced[metric] - base[metric], 3)
                block[f"tracing_overhead_{metric.removesuffix('_ms_p50')}_p50_pct"] = round(
                    100 * (traced[metric] / base[metric] - 1), 2)
        result[f"concurrency_{c}"] = block
    first = result[f"concurrency_{concurrencies[0]}"]
    last = result[f"concurrency_{concurrencies[-1]}"]
    result["added_ttft_ms_p50"] = first["added_ttft_ms_p50"]
    result[f"tpot_ratio_c{concurrencies[0]}"] = first["disaggregated_tpot_ratio_p50"]
    result[f"e2e_ratio_c{concurrencies[-1]}"] = last["disaggregated_e2e_ratio_p50"]
    result[f"messages_per_token_c{concurrencies[-1]}"] = last["disaggregated"]["messages_per_token"]
    targets = {"added_ttft_ms_p50": 8.0, f"tpot_ratio_c{concurrencies[0]}": 1.15, f"e2e_ratio_c{concurrencies[-1]}": 2.0}
    result["targets"] = targets
    result["meets_targets"] = {k: result[k] <= v for k, v in targets.items()}
    raw = {"disaggregated": {}, "traced": {}}
    for c in concurrencies:
        block = result[f"concurrency_{c}"]
        for name in (*PATHS, TRACED, "direct", "direct_beside_colocated"):
            if name in block:
                ttfts = block[name].pop("_ttft_ms")
                if name in ("disaggregated", TRACED):
                    raw["disaggregated" if name == "disaggregated" else "traced"][str(c)] = ttfts
    if tracing:
        from pdserve.bench.tracing_cost import summarize

        summarize(result, raw, sink_endpoint)
        result["tracing_overhead_ttft_p50_pct"] = first["tracing_overhead_ttft_p50_pct"]
        result["tracing_overhead_ttft_p50_pct_ci95"] = first["tracing_overhead_ttft_p50_pct_ci95"]
        result["target_tracing_overhead_ttft_p50_pct"] = 3.0
    if sink:
        sink[0].stop(grace=None)
    return result


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench router", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="one-line JSON")
    p.add_argument("--requests", type=int, default=64, help="requests per concurrency level (at least 4x it)")
    p.add_argument("--concurrency", default="1,16", help="comma-separated closed-loop concurrency levels")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment for every Serve replica, e.g. OTEL_TRACES_EXPORTER=otlp (repeatable)")
    p.add_argument("--tracing", action="store_true",
                   help="also run the disaggregated app tracing every request (sampling 1.0) to a local OTLP sink")
    p.add_argument("--no-coalesce", action="store_true", help="one message per token on every hop (attribution)")
    p.add_argument("--stream-interval-ms", type=float, default=0.0, help="cap stream messages at one per interval")
    p.add_argument("--serve-threads", action="store_true",
                   help="replicas run user code and the handles' router on Serve's own thread and loop (Serve's "
                        "defaults; pdserve serve runs them on the replica's event loop) (attribution)")
    p.add_argument("--ingress", choices=["direct", "proxy"], default="direct",
                   help="how HTTP reaches the router (pdserve serve's default: direct)")
    p.add_argument("--no-worker-link", action="store_true",
                   help="router -> worker calls through Serve handles, not the worker link (attribution)")
    p.add_argument("--no-grpc-handles", action="store_true",
                   help="deployments call each other as Ray actor calls, not Serve's gRPC (attribution)")
    p.add_argument("--worker-niceness", type=int, default=0,
                   help="niceness of the Ray workers (Ray's own default: 15; pdserve serve: 0)")
    p.add_argument("--isolated", action="store_true",
                   help="measure each path alone, one after another, instead of alternating requests between "
                        "them (at concurrency 16 alternating paths split the CPU, so E2E compares CPU shares)")
    p.add_argument("--model", default="tiny", help="a model name or checkpoint directory (default: tiny)")
    p.add_argument("--poll-dashboard", type=float, default=0.0, metavar="HZ",
                   help="fetch every routed app's /dashboard/data HZ times a second during the run (its cost)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    streaming: dict[str, Any] = {"stream_coalesce": not args.no_coalesce, "stream_interval_ms": args.stream_interval_ms,
                                 "worker_link": not args.no_worker_link}
    env = dict(item.split("=", 1) for item in args.env)
    if args.serve_threads:
        from pdserve.runtime.serve_env import SERVE_LATENCY_ENV

        env.update({key: "1" for key in SERVE_LATENCY_ENV})
    # stdout carries the JSON alone: Ray prints driver-side notices (e.g. a raylet's at shutdown) there
    with contextlib.redirect_stdout(sys.stderr):
        result = run(args.requests, tuple(int(c) for c in args.concurrency.split(",")), args.prompt_tokens,
                     args.output_tokens, args.seed, env, args.tracing, streaming, args.ingress,
                     not args.no_grpc_handles, args.worker_niceness, args.isolated, args.model, args.poll_dashboard)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
