"""Several router replicas, live: a rendered RayService on a local multi-node Ray cluster (as
multinode_driver.py builds it), in its own process.

    python multirouter_driver.py RAYSERVICE_JSON OUT_JSON

With the chart's router replicas (2), and again with 1 (the same cluster, the serve config applied again):
streamed completions at a fixed concurrency through Serve's proxy while /metrics is sampled, giving the
running sequences per decode replica over time and the router replicas seen in the series. Then, with 2
routers, one router replica is killed (SIGKILL) while streams run: which streams broke, by the router
that answered each (X-Pdserve-Router), and how long until a new request succeeded. Writes JSON.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

_spec = importlib.util.spec_from_file_location("pdserve_multinode_driver", Path(__file__).with_name("multinode_driver.py"))
multinode = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(multinode)

CONCURRENCY, REQUESTS, MAX_TOKENS = 8, 64, 96
MAX_KILL_STREAMS = 24


def _stream(base: str, i: int, max_tokens: int = MAX_TOKENS, progress: dict[int, int] | None = None,
            routers: dict[int, str] | None = None) -> dict[str, Any]:
    """One streamed completion over plain HTTP; what came back, and which router answered (`progress`:
    chunks so far, by `i`, and `routers`: the answering router, by `i`, for a watcher)."""
    body = json.dumps({"model": "tiny", "prompt": f"Request {i}: the routers share what they placed. " * 2,
                       "max_tokens": max_tokens, "stream": True, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    out = {"router": None, "status": None, "chunks": 0, "done": False, "error": None}
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            out["status"], out["router"] = response.status, response.headers.get("x-pdserve-router")
            if routers is not None and out["router"]:
                routers[i] = out["router"]
            for line in response:
                line = line.strip()
                if line == b"data: [DONE]":
                    out["done"] = True
                elif line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out["error"] = chunk["error"].get("message")
                    else:
                        out["chunks"] += 1
                        if progress is not None:
                            progress[i] = out["chunks"]
    except Exception as exc:  # a stream cut by the router's death
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def _running_by_decode(base: str) -> tuple[dict[str, float], set[str], float]:
    """Running sequences per decode replica, the router replicas in the series, and the sync messages the
    answering router received (a router-only series: each scrape through the proxy reaches one router)."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    running = {labels["replica"]: v for labels, v in multinode._metric_samples(text, "pdserve_requests_running")
               if labels.get("role") == "decode"}
    routers = {labels["replica"] for labels, _ in multinode._metric_samples(text, "pdserve_generation_tokens_total")
               if labels.get("role") == "router"}
    received = sum(v for labels, v in multinode._metric_samples(text, "pdserve_router_placement_sync_messages_total")
                   if labels.get("direction") == "received")
    return running, routers, received


def load(base: str) -> dict[str, Any]:
    """REQUESTS streams at CONCURRENCY, /metrics sampled every 0.2 s meanwhile."""
    samples, routers, received, stop = [], set(), [0.0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                running, seen, heard = _running_by_decode(base)
                routers.update(seen)
                received[0] = max(received[0], heard)
                if sum(running.values()):
                    samples.append(running)
            except OSError:
                pass
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(lambda i: _stream(base, i), range(REQUESTS)))
    stop.set()
    sampler.join()
    # spread: per sample, the busiest decode replica's running sequences over the mean across replicas
    imbalance = [max(s.values()) / statistics.fmean(s.values()) for s in samples if len(s) >= 2]
    return {"seconds": time.monotonic() - started, "ok": sum(r["done"] for r in results),
            "answered_by": sorted({r["router"] for r in results if r["router"]}),
            "routers_in_metrics": sorted(routers), "num_samples": len(samples), "sync_received_max": received[0],
            "imbalance_mean": statistics.fmean(imbalance) if imbalance else None,
            "imbalance_p90": sorted(imbalance)[int(0.9 * (len(imbalance) - 1))] if imbalance else None,
            "decode_replicas": sorted({r for s in samples for r in s})}


def kill_one_router(base: str, router_pids: dict[str, int]) -> dict[str, Any]:
    """Long streams on both routers; SIGKILL one router replica mid-stream; then new requests until one succeeds.

    Serve's proxy picks the router replica per request, and it may put a whole burst on one of them: streams
    are added (up to MAX_KILL_STREAMS) until each router carries at least one, so the kill always cuts some
    streams and spares others."""
    with ThreadPoolExecutor(MAX_KILL_STREAMS) as pool:
        progress: dict[int, int] = {}
        routers: dict[int, str] = {}
        futures = [pool.submit(_stream, base, i, 1500, progress, routers) for i in range(CONCURRENCY)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            started = len(progress) == len(futures) and min(progress.values()) >= 8  # none near its end
            if started and len(set(routers.values())) >= len(router_pids):
                break
            if started and len(futures) < MAX_KILL_STREAMS:
                futures.append(pool.submit(_stream, base, len(futures), 1500, progress, routers))
            time.sleep(0.01)
        carried = sorted(set(routers.values()) & set(router_pids)) or sorted(router_pids)
        victim = carried[0]
        os.kill(router_pids[victim], signal.SIGKILL)
        killed_at = time.monotonic()
        first_ok, attempts = None, 0
        while first_ok is None and time.monotonic() - killed_at < 60:
            attempts += 1
            if _stream(base, 5000 + attempts, 4)["done"]:
                first_ok = time.monotonic() - killed_at
            else:
                time.sleep(0.1)
        streams = [f.result() for f in futures]
    return {"victim": victim, "streams": streams, "new_request_ok_after_s": first_ok, "attempts": attempts}


def _router_pids(dashboard: str) -> dict[str, int]:
    from ray.util.state import list_actors

    return {a.name.rsplit("#", 1)[-1]: a.pid for a in list_actors(
        address=dashboard, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
        if a.class_name == "ServeReplica:pdserve:router"}


def run(rayservice: dict[str, Any]) -> dict[str, Any]:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from pdserve.runtime.redis_server import free_port

    spec = rayservice["spec"]["rayClusterConfig"]
    os.environ.update(multinode.ray_env(spec["headGroupSpec"]))
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    http_port = free_port()
    serve_config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    serve_config.pop("grpc_options", None)
    dashboard_port = free_port()
    cluster = Cluster(initialize_head=True, head_node_args={
        **multinode.node_args(spec["headGroupSpec"]), "include_dashboard": True, "dashboard_host": "127.0.0.1",
        "dashboard_port": dashboard_port})
    for group in spec["workerGroupSpecs"]:
        for _ in range(group.get("replicas", 1)):
            cluster.add_node(**multinode.node_args(group))
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    base, dashboard = f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{dashboard_port}"
    try:
        cluster.wait_for_nodes()
        serve.start(http_options=serve_config["http_options"])
        out: dict[str, Any] = {}
        (app,) = [a for a in serve_config["applications"] if a["name"] == "pdserve"]
        router = app["args"]["router"]  # pdserve's SystemConfig: the router section sets its replicas
        for num_routers in (router["num_replicas"], 1):
            router["num_replicas"] = num_routers
            _get_global_client().deploy_apps(ServeDeploySchema.model_validate(serve_config))
            if error := _wait_running(serve, [a["name"] for a in serve_config["applications"]], dashboard,
                                      num_routers):
                return {"error": error, **out}
            _stream(base, -1, 4)  # warm: every replica's stats reach the routers
            time.sleep(1.0)
            out[f"load_{num_routers}_routers"] = load(base)
            if num_routers > 1:
                out["kill"] = kill_one_router(base, _router_pids(dashboard))
        return out
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def _wait_running(serve, names: list[str], dashboard: str, num_routers: int) -> str | None:
    deadline = time.monotonic() + 240
    while True:
        status = serve.status()
        states = {n: status.applications[n].status if n in status.applications else "MISSING" for n in names}
        if all(s == "RUNNING" for s in states.values()) and len(_router_pids(dashboard)) == num_routers:
            return None
        if time.monotonic() > deadline:
            return f"applications not running: {states}"
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(multinode.run_cli(run, sys.argv[1:]))
