"""`pdserve` command line: a local generation demo and benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    from pdserve.config import EngineConfig, SchedulerConfig
    from pdserve.engine import LLM
    from pdserve.sampling_params import SamplingParams

    llm = LLM(EngineConfig(model=args.model, dtype=args.dtype, scheduler=SchedulerConfig(max_model_len=args.max_model_len)))
    prompts = args.prompt or ["Hello, pdserve!"]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
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

        result = run(quick=args.quick, seed=args.seed)
    elif args.target == "kernels":
        from pdserve.bench.kernels import run

        result = run(quick=args.quick, seed=args.seed)
    elif args.target == "transfer":
        from pdserve.bench.transfer import run

        sizes = [1, 16] if args.quick else None
        result = run(sizes_mib=sizes, transports=args.transports.split(",") if args.transports else None)
    else:
        raise SystemExit(f"unknown bench target {args.target!r}")
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="run prompts through a local engine")
    gen.add_argument("--model", default="tiny", help="'tiny' (embedded) or a Hugging Face checkpoint directory")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.set_defaults(func=_generate)
    bench = sub.add_parser("bench", help="benchmarks that print one JSON object")
    bench.add_argument("target", choices=["engine", "kernels", "transfer", "router"],
                       help="router: run by the `pdserve` console script (it needs the services)")
    bench.add_argument("--transports", default=None, help="transfer: comma-separated subset of local,redis,ucx")
    bench.add_argument("--json", action="store_true", help="one-line JSON")
    bench.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    bench.add_argument("--seed", type=int, default=0)
    bench.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
