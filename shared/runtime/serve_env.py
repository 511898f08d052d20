"""The Ray Serve settings pdserve serves with: how HTTP and gRPC reach the router, straight into its
replica ("direct") or through Serve's proxy, and how deployments call each other (gRPC).

Direct ingress (Ray Serve's `RAY_SERVE_ENABLE_DIRECT_INGRESS`) runs the HTTP and gRPC servers inside
the ingress replica, so a token crosses one Ray hop (decode -> router) instead of two (decode ->
router -> proxy) and the router no longer re-sends every chunk to a proxy actor. Serve gives each
ingress replica a port from a per-node range; a range of exactly the user's port leaves one router
replica per node on it, and every other app must then have no ingress of its own. Serve's proxy still
starts on the head node, on a port nobody is told about.

Ray workers run at nice 0 (Ray's default is 15), and deployment handles use Serve's gRPC transport
(`RAY_SERVE_USE_GRPC_BY_DEFAULT`) rather than Ray actor calls: each streamed item then costs the
sender and receiver a gRPC message instead of a Ray object report, which on 2 cores cut the router's
CPU per token by more than half. Every replica runs its user code and its handles' router on its own
event loop (`SERVE_LATENCY_ENV`, as Ray Serve LLM runs its LLM replicas) instead of Serve's separate
thread and loop: in a 96-request A/B with the worker link (`pdserve bench router`, 2 cores), added TTFT
6.0 / 7.9 ms and TPOT ratio 1.13 / 1.13 against 8.3 / 7.9 ms and 1.19 / 1.21 (`--serve-threads`
measures Serve's defaults).

glibc's malloc gives threads arenas of their own, up to eight per core, and a Ray worker runs tens of
threads: after a load, partly used arenas held about 40 MiB more across `make serve`'s processes than with
two arenas a process (`MALLOC_ARENA_MAX=2`, three alternating pairs: 1,920-1,938 MiB in all against
1,887-1,890). A value the user has set is kept.

The settings are environment variables read when Serve's modules load, so they must be in the
environment of the process that starts Ray, before `ray.init`, and so in every Ray worker.
"""

from __future__ import annotations

import http.client
import json
import os
import urllib.request
from typing import Literal

IngressMode = Literal["direct", "proxy"]

# Ray starts workers at nice 15, below everything else on the host; here the replicas are the workload
SERVE_LATENCY_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
BASE_ENV = {"RAY_SERVE_USE_GRPC_BY_DEFAULT": "1", "RAY_worker_niceness": "0", **SERVE_LATENCY_ENV}
MALLOC_ARENA_MAX = "2"


def serve_env(
    ingress: IngressMode, http_port: int, grpc_port: int | None, grpc_handles: bool = True, num_ports: int = 1,
    worker_niceness: int = 0,
) -> dict[str, str]:
    """Everything pdserve sets for Ray and Serve; `grpc_handles=False` keeps Ray actor calls and
    `worker_niceness=15` Ray's default priority (both for attribution)."""
    env = {**BASE_ENV, "RAY_SERVE_USE_GRPC_BY_DEFAULT": str(int(grpc_handles)),
           "RAY_worker_niceness": str(worker_niceness),
           "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", MALLOC_ARENA_MAX)}
    if ingress == "direct":
        env.update(direct_ingress_env(http_port, grpc_port, num_ports))
    return env


def direct_ingress_env(http_port: int, grpc_port: int | None, num_ports: int = 1) -> dict[str, str]:
    """Serve's settings for direct ingress on `num_ports` consecutive ports from `http_port` (and
    `grpc_port`). Ingress replicas drain for 1 s on shutdown, not Serve's 30 s for external load
    balancers: nothing outside this machine tracks them."""
    env = {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http_port + num_ports),
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
    }
    if grpc_port:
        env["RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT"] = str(grpc_port)
        env["RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT"] = str(grpc_port + num_ports)
    return env


def routes_at(host: str, port: int, timeout_s: float = 2.0) -> dict[str, str]:
    """{route prefix: app name} that the ingress listening on `port` serves; {} when none answers."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/-/routes", timeout=timeout_s) as reply:
            routes = json.loads(reply.read())
    except (OSError, ValueError, http.client.HTTPException):  # another protocol's server on the port
        return {}
    return routes if isinstance(routes, dict) else {}


def app_ports(host: str, ports: range) -> dict[str, int]:
    """{app name: port} for the direct-ingress replicas listening on `ports`."""
    return {app: port for port in ports for app in routes_at(host, port).values()}
