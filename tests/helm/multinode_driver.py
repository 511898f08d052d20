"""Runs a rendered RayService on a local multi-node Ray cluster (one raylet per node), in its own process.

    python multinode_driver.py RAYSERVICE_JSON OUT_JSON

Nodes: the head with its rayStartParams, then `replicas` nodes per worker group with the CPUs
KubeRay gives the pod (top-level `resources`, else rayStartParams num-cpus, else the container's
cpu limit), the group's custom resources and its Ray `labels`. serveConfigV2 is deployed through
Serve's own config path (the controller's apply_config, what `serve deploy` and KubeRay reach
through the dashboard), with its HTTP/gRPC ports moved to free loopback ports, and with the RAY_*
variables the chart sets in the head pod (they reach every node's workers from there). One completion is
streamed; the result (node of every replica, the decode replica's KV imports by transport, the
streamed text) is written as JSON for the test to judge.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import yaml


class Serving(NamedTuple):
    base: str  # the HTTP API
    names: list[str]  # applications
    groups: dict[str, str]  # node id -> worker group
    head_node_id: str
    dashboard: str
    deploy_s: float


def _cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def node_args(spec: dict[str, Any]) -> dict[str, Any]:
    """Ray start arguments KubeRay derives for one pod of a group."""
    params = spec.get("rayStartParams") or {}
    top = dict(spec.get("resources") or {})
    container = spec["template"]["spec"]["containers"][0].get("resources", {})
    limits = {**container.get("requests", {}), **container.get("limits", {})}
    if "CPU" in top:
        num_cpus = _cpus(top.pop("CPU"))
    elif "num-cpus" in params:
        num_cpus = _cpus(params["num-cpus"])
    else:
        num_cpus = math.floor(_cpus(limits.get("cpu", 1)))
    num_gpus = int(top.pop("GPU", params.get("num-gpus", limits.get("nvidia.com/gpu", 0))))
    top.pop("memory", None)
    args: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus,
                            "resources": {k: float(v) for k, v in top.items()}}
    if spec.get("labels"):
        args["labels"] = dict(spec["labels"])
    return args


def ray_env(spec: dict[str, Any]) -> dict[str, str]:
    """The RAY_* variables with plain values in a group's pod: Ray and Serve read them where Ray starts."""
    env = spec["template"]["spec"]["containers"][0].get("env", [])
    return {e["name"]: e["value"] for e in env if e["name"].startswith("RAY_") and "value" in e}


def _metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


@contextlib.contextmanager
def serving(rayservice: dict[str, Any]) -> Iterator[Serving]:
    """The RayService's cluster up with its serve config deployed and running; torn down on exit. Raises
    RuntimeError when the applications do not reach RUNNING."""
    import os

    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.serve.config import gRPCOptions
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    from pdserve.runtime.redis_server import free_port

    cluster_spec = rayservice["spec"]["rayClusterConfig"]
    # the nodes' raylets (and so every replica) start with the pod's settings; this driver's own Serve
    # modules loaded without them, as a client outside the cluster would (its handles are synchronous)
    os.environ.update(ray_env(cluster_spec["headGroupSpec"]))
    serve_config = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    http_port, grpc_port = free_port(), free_port()
    serve_config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    if "grpc_options" in serve_config:
        serve_config["grpc_options"]["port"] = grpc_port
    head = node_args(cluster_spec["headGroupSpec"])
    # the dashboard runs on the head as under KubeRay (dashboard-host); Ray's state API reads through it
    dashboard_port = free_port()
    cluster = Cluster(initialize_head=True, head_node_args={**head, "include_dashboard": True,
                                                            "dashboard_host": "127.0.0.1", "dashboard_port": dashboard_port})
    groups = {}
    for group in cluster_spec["workerGroupSpecs"]:
        for _ in range(group.get("replicas", 1)):
            node = cluster.add_node(**node_args(group))
            groups[node.node_id] = group["groupName"]
    t0 = time.monotonic()
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        cluster.wait_for_nodes()
        grpc = serve_config.get("grpc_options")
        serve.start(http_options=serve_config["http_options"],
                    grpc_options=gRPCOptions(**grpc) if grpc else None)
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate(serve_config))
        names = [a["name"] for a in serve_config["applications"]]
        deadline = time.monotonic() + 240
        while True:
            status = serve.status()
            states = {n: status.applications[n].status if n in status.applications else "MISSING" for n in names}
            if all(s == "RUNNING" for s in states.values()):
                break
            failed = {n: status.applications[n].message for n in names
                      if n in status.applications and status.applications[n].status in ("DEPLOY_FAILED", "UNHEALTHY")}
            if failed or time.monotonic() > deadline:
                raise RuntimeError(f"applications not running: {states} {failed}")
            time.sleep(1)
        yield Serving(f"http://127.0.0.1:{http_port}", names, groups, cluster.head_node.node_id,
                      f"http://127.0.0.1:{dashboard_port}", time.monotonic() - t0)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def replica_nodes(serving: Serving) -> list[dict[str, Any]]:
    """Each live Serve replica: class and actor name, node, the worker group of that node and its labels."""
    import ray
    from ray.util.state import list_actors

    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    replicas = []
    for actor in list_actors(address=serving.dashboard, filters=[("state", "=", "ALIVE")], detail=True, limit=1000):
        if not actor.class_name.startswith("ServeReplica:"):
            continue
        node = nodes.get(actor.node_id, {})
        replicas.append({"class_name": actor.class_name, "name": actor.name, "node_id": actor.node_id,
                         "group": serving.groups.get(actor.node_id, "head" if actor.node_id == serving.head_node_id else None),
                         "labels": {k: v for k, v in node.get("Labels", {}).items() if not k.startswith("ray.io/")}})
    return replicas


def run(rayservice: dict[str, Any]) -> dict[str, Any]:
    try:
        with serving(rayservice) as up:
            return _one_completion(up)
    except RuntimeError as exc:
        return {"error": str(exc)}


def _one_completion(up: Serving) -> dict[str, Any]:
    from openai import OpenAI
    from ray import serve

    base, names = up.base, up.names

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    prompt = "The cluster runs prefill on one node and decode on another; " * 6  # long: disaggregated
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=12, stream=True,
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    metrics = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
    transfers = [(l, v) for l, v in _metric_samples(metrics, "pdserve_kv_transfer_bytes_count")]
    transferred = [(l, v) for l, v in _metric_samples(metrics, "pdserve_kv_transfer_bytes_sum")]
    fallbacks = [(l, v) for l, v in _metric_samples(metrics, "pdserve_fallbacks_total")]
    decisions = [(l, v) for l, v in _metric_samples(metrics, "pdserve_disaggregation_decisions_total")]
    kvstore = (serve.get_app_handle("kvstore").stats.remote().result(timeout_s=60)
               if "kvstore" in names else None)
    replicas = replica_nodes(up)
    status = serve.status()
    return {
        "deploy_s": up.deploy_s, "text": text, "num_chunks": len(chunks), "model": model,
        "replicas": replicas, "groups": up.groups, "head_node_id": up.head_node_id,
        "kv_transfers": [{"labels": l, "count": v} for l, v in transfers],
        "kv_bytes": [{"labels": l, "sum": v} for l, v in transferred],
        "fallbacks": [{"labels": l, "value": v} for l, v in fallbacks],
        "decisions": [{"labels": l, "value": v} for l, v in decisions],
        "kvstore_stats": kvstore,
        "statuses": {n: status.applications[n].status for n in names},
    }


def run_cli(run: Callable[[dict[str, Any]], dict[str, Any]], argv: list[str]) -> int:
    """A driver's command line: RAYSERVICE_JSON in, `run`'s result out as OUT_JSON; 1 when it holds an error."""
    with open(argv[0]) as f:
        result = run(json.load(f))
    with open(argv[1], "w") as f:
        json.dump(result, f, indent=2, default=str)
    return 0 if "error" not in result else 1


def main(argv: list[str]) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
