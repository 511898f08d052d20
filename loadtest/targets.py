"""Where load goes: a URL checked to be loopback, or a pdserve system deployed on a local Ray Serve."""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx

from pdserve.registry import load
from pdserve.runtime.serve_env import IngressMode, app_ports, serve_env

# what a target deploys, by import path (as a Serve config file names it): the builder validates the dict
APP_BUILDERS = {"system": "pdserve.services.app:build_system"}


def is_loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_url(url: str, allow_remote: bool = False) -> str:
    """The URL without a trailing slash; ValueError for a non-loopback host unless allowed."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    if not allow_remote and not is_loopback_host(parts.hostname):
        raise ValueError(f"refusing to load {parts.hostname!r}: only loopback targets unless --allow-remote")
    return url.rstrip("/")


def wait_healthy(base_url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            try:
                resp = client.get(f"{base_url}/health")
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.5)
    raise TimeoutError(f"{base_url}/health did not answer 200 within {timeout_s:.0f} s ({last})")


@dataclass(frozen=True)
class LocalServe:
    """A Ray Serve HTTP proxy on this host. `owned`: started here, so shut down here as well."""

    host: str
    port: int
    owned_ray: bool
    owned_serve: bool
    direct_ports: range | None = None  # direct ingress: each app's router listens on one of these

    def url(self, route_prefix: str, app_name: str | None = None) -> str:
        """An app's base URL: its router's own port with direct ingress, else the proxy's."""
        port = self.port
        if self.direct_ports is not None and app_name is not None:
            port = app_ports(self.host, self.direct_ports).get(app_name, port)
        host = f"[{self.host}]" if ":" in self.host else self.host
        return check_url(f"http://{host}:{port}{route_prefix.rstrip('/')}")


@contextmanager
def local_serve(
    ray_options: dict[str, Any] | None = None, port: int = 0, ingress: IngressMode = "direct",
) -> Iterator[LocalServe]:
    """Joins a Ray + Serve already running in this process (tests), else starts local ones, with the
    settings `pdserve serve` uses (direct ingress by default: each app's router on a port of its own).

    An instance not started here is never shut down here.
    """
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    from pdserve.runtime.redis_server import free_port

    owned_ray = not ray.is_initialized()
    direct_ports = None
    if owned_ray:
        if ingress == "direct":
            first = free_port()
            direct_ports = range(first, first + 4)  # an app deployed at a time, and room for a restart
        os.environ.update(serve_env(ingress, direct_ports.start if direct_ports else 0, None,
                                    num_ports=len(direct_ports) if direct_ports else 1))
        # address="local": a fresh instance of our own, never an unrelated cluster found on the host
        ray.init(**{"address": "local", "include_dashboard": False, "configure_logging": False,
                    "log_to_driver": False, **(ray_options or {})})
    owned_serve = False
    try:
        client = _get_global_client(raise_if_no_controller_running=False)
        if client is None:
            port = port or free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            owned_serve = True
            client = _get_global_client()
        http = client.http_config
        host = http.host if http.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        yield LocalServe(host, http.port, owned_ray, owned_serve, direct_ports)
    finally:
        if owned_serve:
            serve.shutdown()
        if owned_ray:
            ray.shutdown()


@contextmanager
def deployed(local: LocalServe, system: dict[str, Any], app_name: str, route_prefix: str = "/",
             health_timeout_s: float = 180.0) -> Iterator[str]:
    """Deploys a SystemConfig (as a dict) as one Serve application; yields its base URL; deletes it afterwards.

    The app comes from its builder's import path, as in a Serve config file: the load tester is a client
    of the services and imports none of them."""
    from ray import serve

    build = load(APP_BUILDERS, "system", "app builder")
    try:
        serve.run(build(system), name=app_name, route_prefix=route_prefix)
        url = local.url(route_prefix, app_name)
        wait_healthy(url, health_timeout_s)
        yield url
    finally:
        serve.delete(app_name)
