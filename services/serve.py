"""`pdserve serve`: the whole system on a local Ray instance, from a config file and flags, until Ctrl-C or
SIGTERM; a local Redis for the KV tier when a server binary exists."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from pdserve.models.resolve import DEFAULT_MODEL
from pdserve.services.serve_checks import (
    ConfigError,
    QuantizationCheck,
    check_quantization,
    check_tensor_parallel,
    quantizations,
    tensor_parallel_sizes,
)

__all__ = ["ConfigError", "check_quantization", "check_tensor_parallel", "quantizations", "run", "system_config",
           "tensor_parallel_sizes"]


def _read_config(path: str) -> dict[str, Any]:
    """The settings a config file sets, validated as a SystemConfig."""
    import yaml
    from pydantic import ValidationError

    from pdserve.services.app import SystemConfig, config_errors

    try:
        return SystemConfig.from_yaml(path).model_dump(exclude_unset=True)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise ConfigError(f"{where}: invalid YAML: {getattr(exc, 'problem', None) or exc}") from None
    except ValidationError as exc:
        raise ConfigError("\n".join(f"{path}: {line}" for line in config_errors(exc))) from None


def system_config(args: argparse.Namespace, redis_url: str | None):
    """The config file's settings with the flags over them; raises ConfigError."""
    from pydantic import ValidationError

    from pdserve.services.app import SystemConfig, config_errors

    base = _read_config(args.config) if args.config else {}
    for key in ("model", "mode", "transport", "kv_cache_dtype"):
        if getattr(args, key):
            base[key] = getattr(args, key)
    base.setdefault("model", DEFAULT_MODEL)
    if redis_url:
        base["redis_url"] = redis_url
    for role, count in (("prefill", args.prefill_replicas), ("decode", args.decode_replicas)):
        if count:
            base.setdefault(role, {})["num_replicas"] = count
        if getattr(args, "quantization", None):
            base.setdefault(role, {})["quantization"] = args.quantization
        if getattr(args, "tensor_parallel_size", None):
            base.setdefault(role, {})["tensor_parallel_size"] = args.tensor_parallel_size
    if args.api_key:
        base.setdefault("router", {})["api_keys"] = args.api_key
    if args.api_key_file:
        base.setdefault("router", {})["api_keys_file"] = str(Path(args.api_key_file).resolve())
    try:
        return SystemConfig.model_validate(base)
    except ValidationError as exc:
        raise ConfigError("\n".join(config_errors(exc))) from None


def _start_redis(config):
    """A local Redis with a generated AUTH password and the kvstore's settings, and its supervisor."""
    from pdserve.runtime.redis_health import redis_settings
    from pdserve.runtime.redis_server import RedisServer, RedisSupervisor, generate_password
    from pdserve.services.kvstore.config import KVStoreConfig

    kv = KVStoreConfig.model_validate(config.kvstore)
    server = RedisServer(password=generate_password(),
                         settings=redis_settings(kv.maxmemory_bytes, kv.maxmemory_policy)).start()
    supervisor = RedisSupervisor(server, report=lambda message: print(f"pdserve serve: {message}", flush=True))
    return server, supervisor.start()


def _ingress(args: argparse.Namespace, config) -> str:
    """The ingress mode to run, with Serve's settings for it put into this process's environment, which
    `ray.init` hands to every Ray worker."""
    import os

    from pdserve.runtime.serve_env import serve_env

    ingress = args.ingress
    if ingress == "direct" and config.router.get("num_replicas", 1) > 1:
        print("several router replicas share one port only through Serve's proxy: --ingress proxy", flush=True)
        ingress = "proxy"
    os.environ.update(serve_env(ingress, args.port, args.grpc_port))
    return ingress


class DeployFailed(RuntimeError):
    """Serve gave up on a deployment of the app."""


def _wait_running(names: list[str], stop: threading.Event, poll_s: float = 0.5) -> bool:
    """Until every Serve app in `names` runs (True) or `stop` is set (False); a failed deploy raises."""
    from ray import serve

    while not stop.is_set():
        apps = serve.status().applications
        states = {name: apps[name] for name in names if name in apps}
        failed = [f"{n}: {a.message}" for n, a in states.items() if a.status == "DEPLOY_FAILED"]
        if failed:
            raise DeployFailed("deployment failed: " + "; ".join(failed))
        if len(states) == len(names) and all(a.status == "RUNNING" for a in states.values()):
            return True
        stop.wait(poll_s)
    return False


def _ports_blocked(args: argparse.Namespace, stop: threading.Event) -> int | None:
    """Exit code 2 when a port the router will bind is taken, checked before anything starts (Serve would
    otherwise fail deep in a replica's log and block the port for good); waits out a just-stopped
    server's TIME_WAIT connections. None: the ports are free."""
    from pdserve.runtime.ports import IN_USE, holder, wait_bindable

    ports = {"--port": args.port, **({"--grpc-port": args.grpc_port} if args.grpc_port else {})}
    blocked = wait_bindable(args.host, ports, stop, lambda m: print(f"pdserve serve: {m}", flush=True))
    if stop.is_set():
        return _stopped()
    for flag, state in blocked.items():
        by = holder(ports[flag]) if state == IN_USE else None
        why = (f"is in use by another program{f', {by}' if by else ''}" if state == IN_USE
               else "did not free within a minute")
        print(f"pdserve serve: port {ports[flag]} ({flag}) {why}; stop that program or choose another {flag}",
              file=sys.stderr, flush=True)
    return 2 if blocked else None


def _router_could_not_bind(args: argparse.Namespace) -> int | None:
    """Exit code 2, naming the port and its holder, when a program took a router port after the check at
    start (Serve reports only that the router deployment failed); None when the ports are not taken."""
    from pdserve.runtime.ports import IN_USE, holder, port_state

    ports = {"--port": args.port, **({"--grpc-port": args.grpc_port} if args.grpc_port else {})}
    taken = {flag: port for flag, port in ports.items() if port_state(args.host, port) == IN_USE}
    for flag, port in taken.items():
        by = holder(port)
        print(f"pdserve serve: the router replica could not bind port {port} ({flag}): another program took it "
              f"after start{f', {by}' if by else ''}; stop that program or choose another {flag}",
              file=sys.stderr, flush=True)
    return 2 if taken else None


def _wait_ports_released(args: argparse.Namespace) -> None:
    """Ray's replica processes exit after ray.shutdown returns: until they let go of the ports, a
    `pdserve serve` started right after this one could not bind them."""
    from pdserve.runtime.ports import wait_released

    ports = [args.port, *([args.grpc_port] if args.grpc_port else [])]
    if held := wait_released(args.host, ports):
        print(f"pdserve serve: port {held[0]} is still held after shutdown", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    """`pdserve serve` with its parsed flags: the config checked first, then Redis, Ray and Serve, until a
    signal."""
    try:
        config = system_config(args, args.redis_url)  # the file and the flags, refused before Redis or Ray starts
        check_tensor_parallel(config)
        quantization = QuantizationCheck(config)  # in a child process, while this one imports Ray below
    except ConfigError as exc:
        return _refused(exc)
    stop = threading.Event()  # Ctrl-C or SIGTERM, at any moment: start-up stops at its next step, then cleanup

    def on_signal(*_) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if (blocked := _ports_blocked(args, stop)) is not None:
        quantization.cancel()
        return blocked
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from pdserve.runtime.redis_health import RedisSettingsError, redact_url
    from pdserve.runtime.redis_server import find_server_binary
    from pdserve.services.app import build_system
    from pdserve.services.cpu_shares import Unschedulable, check_labels, fit_cpu_shares
    from pdserve.runtime.ports import listen_port
    from pdserve.runtime.serve_env import routes_at

    try:
        quantization.result()
    except ConfigError as exc:
        return _stopped() if stop.is_set() else _refused(exc)
    redis = supervisor = None
    ray_started = False
    try:
        from pdserve.v1 import SERVICER_FUNCTION

        redis_url = args.redis_url or config.redis_url  # the flag, else the config file's; else one of our own
        if redis_url is None and find_server_binary():
            try:
                redis, supervisor = _start_redis(config)
            except (RedisSettingsError, RuntimeError) as exc:  # settings not kept, or the server would not start
                print(f"pdserve serve: cannot start Redis: {exc}", file=sys.stderr, flush=True)
                return 2
            redis_url = redis.url
            print(f"started a local Redis for the KV store at {redact_url(redis_url)} (AUTH with a generated "
                  f"password; {', '.join(f'{k} {v}' for k, v in redis.settings.items()) or 'server defaults'}; "
                  "restarted if it dies)", flush=True)
        elif redis_url is None:
            print("no Redis URL and no redis-server binary: running without the Redis tier", flush=True)
        config = system_config(args, redis_url)
        if stop.is_set():
            return _stopped()
        ingress = _ingress(args, config)
        # address="local": always a fresh instance of our own, never an unrelated cluster found on the host
        ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, configure_logging=False)
        ray_started = True
        # ray.init replaces the SIGTERM handler with one that kills Ray's processes and exits at once, which
        # skips Serve's shutdown and leaves Ray's agents behind: SIGTERM (Kubernetes, systemd) stops us like Ctrl-C
        signal.signal(signal.SIGTERM, on_signal)
        try:
            check_labels(config, [node.get("Labels") or {} for node in ray.nodes() if node.get("Alive")])
            shares = fit_cpu_shares(config, ray.cluster_resources().get("CPU", 0.0))
        except Unschedulable as exc:
            print(f"pdserve serve: cannot start: {exc}", file=sys.stderr, flush=True)
            return 2
        print(shares.describe(), flush=True)
        config = shares.apply(config)
        if stop.is_set():
            return _stopped()
        # direct ingress: Serve's proxy listens on ports of its own, unannounced; the router on the user's
        http_port, grpc_port = (listen_port(), listen_port()) if ingress == "direct" else (args.port, args.grpc_port)
        grpc_options = (gRPCOptions(port=grpc_port, grpc_servicer_functions=[SERVICER_FUNCTION])
                        if args.grpc_port else None)
        serve.start(http_options={"host": args.host, "port": http_port}, grpc_options=grpc_options)
        serve._run(build_system(config), name="pdserve", route_prefix="/", _blocking=False)
        print(f"loading {config.model} in the replicas ...", flush=True)
        try:
            running = _wait_running(["pdserve"], stop)
        except DeployFailed:
            if (code := _router_could_not_bind(args)) is not None:
                return code
            raise
        if not running:
            return _stopped()
        if ingress == "direct" and "pdserve" not in routes_at(args.host, args.port).values():
            if (code := _router_could_not_bind(args)) is not None:
                return code
            print(f"pdserve serve: the router did not take port {args.port}", file=sys.stderr, flush=True)
            return 1
        url = f"http://{args.host}:{args.port}"
        quant = ", ".join(f"{role} {q}" for role, q in quantizations(config).items())
        tp = ", ".join(f"{role} {n}" for role, n in tensor_parallel_sizes(config).items() if n > 1)
        print(f"pdserve is serving {config.model} ({config.mode}, {config.transport} transport, {ingress} ingress, "
              f"quantization: {quant}{f', tensor parallel: {tp}' if tp else ''}) at {url}", flush=True)
        served = config.served_model_name
        print(f"  curl -N {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"model\": "
              f"\"{served}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of "
              f"France?\"}}], \"stream\": true}}'", flush=True)
        if args.grpc_port:
            print(f"  gRPC pdserve.v1.GenerateService at {args.host}:{args.grpc_port}", flush=True)
        stop.wait()
        return _stopped()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        if ray_started:
            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
            _wait_ports_released(args)
        if supervisor is not None:
            supervisor.stop()
        if redis is not None:
            redis.stop()
        print("pdserve serve: stopped", flush=True)


def _refused(exc: ConfigError) -> int:
    for line in str(exc).splitlines():
        print(f"pdserve serve: {line}", file=sys.stderr, flush=True)
    return 2


def _stopped() -> int:
    print("shutting down", flush=True)
    return 0
