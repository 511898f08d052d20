"""The `pdserve` console script: `pdserve serve` here; every other subcommand is the library's."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve serve", description="run pdserve on a local Ray instance")
    p.add_argument("--config", help="YAML file with a SystemConfig (flags below override it)")
    p.add_argument("--model", help="'tiny' (embedded) or a Hugging Face checkpoint directory")
    p.add_argument("--mode", choices=["disaggregated", "colocated"])
    p.add_argument("--transport", choices=["ucx", "redis"])
    p.add_argument("--redis-url", help="use this Redis; default: start a local one if a server binary exists")
    p.add_argument("--prefill-replicas", type=int)
    p.add_argument("--decode-replicas", type=int)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=9000,
                   help="gRPC API port; Serve's gRPC proxy listens on every interface (0: no gRPC API)")
    p.add_argument("--api-key", action="append", help="require this Bearer key (repeatable)")
    p.add_argument("--api-key-file", help="require a Bearer key listed in this file (one per line)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs for the local Ray instance")
    return p


def _config(args: argparse.Namespace, redis_url: str | None):
    from pdserve.services.app import SystemConfig

    base = SystemConfig.from_yaml(args.config).model_dump() if args.config else {}
    for key in ("model", "mode", "transport"):
        if getattr(args, key):
            base[key] = getattr(args, key)
    if redis_url:
        base["redis_url"] = redis_url
    for role, count in (("prefill", args.prefill_replicas), ("decode", args.decode_replicas)):
        if count:
            base.setdefault(role, {})["num_replicas"] = count
    if args.api_key:
        base.setdefault("router", {})["api_keys"] = args.api_key
    if args.api_key_file:
        base.setdefault("router", {})["api_keys_file"] = str(Path(args.api_key_file).resolve())
    return SystemConfig.model_validate(base)


def serve_main(argv: list[str]) -> int:
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from pdserve.redis_server import RedisServer, find_server_binary
    from pdserve.services.app import build_system
    from pdserve.services.kvstore.app import build_app as build_kvstore
    from pdserve.v1 import SERVICER_FUNCTION

    args = _serve_parser().parse_args(argv)
    stop = threading.Event()  # set by Ctrl-C or SIGTERM, also during startup: then we shut down right after
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    redis = None
    redis_url = args.redis_url
    if redis_url is None and find_server_binary():
        redis = RedisServer().start()
        redis_url = redis.url
        print(f"started a local Redis for the KV store at {redis_url}", flush=True)
    elif redis_url is None:
        print("no Redis URL and no redis-server binary: running without the Redis tier", flush=True)
    config = _config(args, redis_url)
    # address="local": always a fresh instance of our own, never an unrelated cluster found on the host
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, configure_logging=False)
    try:
        grpc_options = (gRPCOptions(port=args.grpc_port, grpc_servicer_functions=[SERVICER_FUNCTION])
                        if args.grpc_port else None)
        serve.start(http_options={"host": args.host, "port": args.port}, grpc_options=grpc_options)
        if (kv := config.kvstore_config()) is not None:
            serve.run(build_kvstore(kv), name="kvstore", route_prefix=None)
        serve.run(build_system(config), name="pdserve", route_prefix="/")
        url = f"http://{args.host}:{args.port}"
        print(f"pdserve is serving {config.model} ({config.mode}, {config.transport} transport) at {url}", flush=True)
        print(f"  curl -N {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{config.model}\", \"prompt\": \"Hello\", \"max_tokens\": 16, \"stream\": true}}'",
              flush=True)
        if args.grpc_port:
            print(f"  gRPC pdserve.v1.GenerateService at {args.host}:{args.grpc_port}", flush=True)
        stop.wait()
        print("shutting down", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        if redis is not None:
            redis.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        return serve_main(argv[1:])
    if argv[:2] == ["bench", "router"]:  # needs the services, which the library's CLI may not import
        from pdserve.services.bench import main as bench_router

        return bench_router(argv[2:])
    from pdserve.cli import main as library_main

    return library_main(argv)


if __name__ == "__main__":
    sys.exit(main())
