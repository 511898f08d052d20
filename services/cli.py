"""The `pdserve` console script: `pdserve serve` here; every other subcommand is the library's."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from pdserve.models.resolve import DEFAULT_MODEL


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve serve", description="run pdserve on a local Ray instance")
    p.add_argument("--config", help="YAML file with a SystemConfig (flags below override it)")
    p.add_argument("--model", help=f"{DEFAULT_MODEL!r} (default), 'tiny' (random weights, for tests), a .gguf "
                   "file or a Hugging Face checkpoint directory")
    p.add_argument("--mode", choices=["disaggregated", "colocated"])
    p.add_argument("--transport", choices=["ucx", "redis"])
    p.add_argument("--redis-url", help="use this Redis (rediss:// for TLS; AUTH as redis://user:password@...); "
                   "default: start a local one, with a generated password, if a server binary exists")
    p.add_argument("--prefill-replicas", type=int)
    p.add_argument("--decode-replicas", type=int)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=9000,
                   help="gRPC API port; Serve's gRPC proxy listens on every interface (0: no gRPC API)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "int8", "fp8_e4m3"],
                   help="KV cache values on both roles: auto (the model dtype, default), int8 or fp8_e4m3")
    p.add_argument("--api-key", action="append", help="require this Bearer key (repeatable)")
    p.add_argument("--api-key-file", help="require a Bearer key listed in this file (one per line)")
    p.add_argument("--ingress", choices=["direct", "proxy"], default="direct",
                   help="direct (default): HTTP and gRPC served inside the router replica; proxy: through "
                   "Serve's proxy actor (one more hop per stream message; needed for several router replicas)")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="CPUs for the local Ray instance (default: all); router, prefill and decode share them")
    return p


class ConfigError(ValueError):
    """Settings `pdserve serve` refuses before starting anything: one line per problem, each naming its key."""


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


def _config(args: argparse.Namespace, redis_url: str | None):
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


def _wait_running(names: list[str], stop: threading.Event, poll_s: float = 0.5) -> bool:
    """Until every Serve app in `names` runs (True) or `stop` is set (False); a failed deploy raises."""
    from ray import serve

    while not stop.is_set():
        apps = serve.status().applications
        states = {name: apps[name] for name in names if name in apps}
        failed = [f"{n}: {a.message}" for n, a in states.items() if a.status == "DEPLOY_FAILED"]
        if failed:
            raise RuntimeError("deployment failed: " + "; ".join(failed))
        if len(states) == len(names) and all(a.status == "RUNNING" for a in states.values()):
            return True
        stop.wait(poll_s)
    return False


def serve_main(argv: list[str]) -> int:
    args = _serve_parser().parse_args(argv)
    try:
        config = _config(args, args.redis_url)  # the file and the flags, refused before Redis or Ray starts
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"pdserve serve: {line}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()  # Ctrl-C or SIGTERM, at any moment: start-up stops at its next step, then cleanup

    def on_signal(*_) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    redis = supervisor = None
    ray_started = False
    try:
        import ray
        from ray import serve
        from ray.serve.config import gRPCOptions

        from pdserve.runtime.redis_health import RedisSettingsError, redact_url
        from pdserve.runtime.redis_server import find_server_binary
        from pdserve.services.app import build_system
        from pdserve.services.cpu_shares import Unschedulable, check_labels, fit_cpu_shares
        from pdserve.runtime.redis_server import free_port
        from pdserve.runtime.serve_env import routes_at
        from pdserve.v1 import SERVICER_FUNCTION

        redis_url = args.redis_url
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
        config = _config(args, redis_url)
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
        http_port, grpc_port = (free_port(), free_port()) if ingress == "direct" else (args.port, args.grpc_port)
        grpc_options = (gRPCOptions(port=grpc_port, grpc_servicer_functions=[SERVICER_FUNCTION])
                        if args.grpc_port else None)
        serve.start(http_options={"host": args.host, "port": http_port}, grpc_options=grpc_options)
        serve._run(build_system(config), name="pdserve", route_prefix="/", _blocking=False)
        print(f"loading {config.model} in the replicas ...", flush=True)
        if not _wait_running(["pdserve"], stop):
            return _stopped()
        if ingress == "direct" and "pdserve" not in routes_at(args.host, args.port).values():
            print(f"pdserve serve: the router did not take port {args.port} (in use?)", file=sys.stderr, flush=True)
            return 1
        url = f"http://{args.host}:{args.port}"
        print(f"pdserve is serving {config.model} ({config.mode}, {config.transport} transport, {ingress} ingress) "
              f"at {url}", flush=True)
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
        if supervisor is not None:
            supervisor.stop()
        if redis is not None:
            redis.stop()
        print("pdserve serve: stopped", flush=True)


def _stopped() -> int:
    print("shutting down", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        return serve_main(argv[1:])
    if argv[:2] == ["bench", "router"]:  # needs the services, which the library's CLI may not import
        from pdserve.services.bench import main as bench_router

        return bench_router(argv[2:])
    if argv[:2] == ["bench", "placement"]:
        from pdserve.services.router.simulate import main as bench_placement

        return bench_placement(argv[2:])
    from pdserve.cli import main as library_main

    return library_main(argv)


if __name__ == "__main__":
    sys.exit(main())
