"""`pdserve bench peer`: pdserve against llama.cpp's server on the same GGUF file, with the same client, one
server at a time.

    pdserve bench peer --json [--concurrency 1,4,16] [--requests 8] [--prompt-tokens 128] [--max-tokens 64]

- pdserve: `pdserve serve` with its default flags (the default model, served from its GGUF file).
- llama.cpp: its C++ HTTP server (the code `llama-server` runs), embedded by the `xllamacpp` wheel and run
  from a scratch virtual environment (`--peer-venv`, made on first use with `pip install xllamacpp==...`): a
  tool, never a project dependency. `--peer-threads` (default: every core) and `--peer-slots` (default: the
  largest concurrency) are its only settings; it reads the same GGUF file.
- Client: asyncio + httpx in this process (no load generator that spins a core): a closed loop at each
  concurrency, `max(--requests, 2c)` requests, each the same random token prompt of `--prompt-tokens` ids
  (a different one per request) through `/v1/completions`, greedy, `ignore_eos`, exactly `--max-tokens` out.
- Figures per server and level: output tok/s (all output tokens over the level's wall time), TTFT p50, ITL p50
  (the gaps between streamed chunks, each spread over the tokens it carried) and TPOT p50; then idle memory
  after the load: RSS and PSS summed over the server's processes, and of its largest worker process
  (pdserve: a prefill or decode replica; llama.cpp: its one process).
- Start-up: `ready_s`, from launch to the first answered completion, and `ready_cpu`: the CPU seconds its
  processes had used by then (by process), and that work over the machine's cores (`floor_s`), the shortest
  start-up these cores allow for it; `ready_over_floor` is how far the start-up stayed from that bound.
- Ratios are pdserve over llama.cpp: `ratio_tok_s_c1`, `ratio_tok_s_c16`, `rss_ratio` (largest worker process).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.bench.peer_servers import LlamaCppServer, PdserveServer, Server, process_cpu, process_memory

XLLAMACPP = "xllamacpp==2026.10.11549"
DEFAULT_VENV = Path.home() / ".cache" / "pdserve" / "peer-venv"


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    arrivals: list[tuple[float, int]] = []  # (seconds since start, tokens in the chunk)
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if any(c.get("text") for c in chunk.get("choices") or ()):
                arrivals.append((time.perf_counter() - start, 1))
    num_tokens = usage if usage is not None else len(arrivals)
    if num_tokens != max_tokens or not arrivals:
        raise RuntimeError(f"expected {max_tokens} tokens, got {num_tokens} in {len(arrivals)} chunks")
    per_chunk = num_tokens / len(arrivals)
    gaps = [(b[0] - a[0]) / per_chunk for a, b in itertools.pairwise(arrivals)]
    e2e = time.perf_counter() - start
    return {"ttft": arrivals[0][0], "e2e": e2e, "tokens": num_tokens, "gaps": gaps,
            "tpot": (e2e - arrivals[0][0]) / max(1, num_tokens - 1)}


def _p50(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


async def _level(url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    results: list[dict[str, Any]] = []
    # a connection per request: llama.cpp's HTTP server drops idle keep-alive connections, and a request sent on
    # one it just closed fails; both servers are measured the same way
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        async def worker() -> None:
            while not queue.empty():
                results.append(await _one(client, url, model, queue.get_nowait(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"concurrency": concurrency, "num_requests": len(results),
            "output_tok_s": round(sum(r["tokens"] for r in results) / wall, 2),
            "ttft_ms_p50": round(1e3 * _p50([r["ttft"] for r in results]), 2),
            "itl_ms_p50": round(1e3 * _p50([g for r in results for g in r["gaps"]]), 2),
            "tpot_ms_p50": round(1e3 * _p50([r["tpot"] for r in results]), 2), "wall_s": round(wall, 2)}


def measure(server: Server, concurrencies: list[int], num_requests: int, prompt_tokens: int, max_tokens: int,
            vocab: int, seed: int, idle_s: float) -> dict[str, Any]:
    rng = random.Random(seed)
    load_before = os.getloadavg()[0]  # other work on the machine skews both servers (llama.cpp's spinning threads most)
    with server:
        started = time.perf_counter()
        server.wait_ready()
        ready_s = time.perf_counter() - started
        start_cpu = process_cpu(server.processes())  # the work start-up took, against the cores it had
        warm = [[rng.randrange(100, vocab) for _ in range(prompt_tokens)] for _ in range(2)]
        asyncio.run(_level(server.url, server.model, warm, 2, max_tokens))
        levels = []
        for c in concurrencies:
            prompts = [[rng.randrange(100, vocab) for _ in range(prompt_tokens)] for _ in range(max(num_requests, 2 * c))]
            levels.append(asyncio.run(_level(server.url, server.model, prompts, c, max_tokens)))
        time.sleep(idle_s)  # idle after the load: what the server keeps
        memory = process_memory(server.processes(), server.is_worker)
    start_cpu["ready_over_floor"] = round(ready_s / max(start_cpu["floor_s"], 1e-9), 3)
    return {"ready_s": round(ready_s, 2), "ready_cpu": start_cpu, "levels": levels, "idle_memory": memory,
            "settings": server.settings, "loadavg_1m_before": round(load_before, 2)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.models.resolve import DEFAULT_MODEL, alias_gguf_path

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    gguf = alias_gguf_path(DEFAULT_MODEL)
    common = {"concurrencies": concurrencies, "num_requests": args.requests, "prompt_tokens": args.prompt_tokens,
              "max_tokens": args.max_tokens, "vocab": 49152, "seed": args.seed, "idle_s": args.idle_s}
    result: dict[str, Any] = {
        "bench": "peer", "gguf": gguf.name, "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "client": "asyncio httpx, in process, closed loop; /v1/completions with token prompts, greedy, ignore_eos",
        "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens}
    servers = {"pdserve": PdserveServer(args.port, DEFAULT_MODEL, args.quantization),
               "llama_cpp": LlamaCppServer(args.peer_venv, XLLAMACPP, gguf, args.port,
                                           args.peer_threads or os.cpu_count(), args.peer_slots or max(concurrencies))}
    for name in args.order.split(","):
        result[name] = measure(servers[name], **common)
    mine, peer = result["pdserve"], result["llama_cpp"]
    for c, a, b in zip(concurrencies, mine["levels"], peer["levels"]):
        result[f"ratio_tok_s_c{c}"] = round(a["output_tok_s"] / b["output_tok_s"], 3)
        result[f"ratio_ttft_c{c}"] = round(a["ttft_ms_p50"] / b["ttft_ms_p50"], 3)
        result[f"ratio_itl_c{c}"] = round(a["itl_ms_p50"] / b["itl_ms_p50"], 3)
    mine_mem, peer_mem = mine["idle_memory"], peer["idle_memory"]
    result["rss_ratio"] = round(mine_mem["largest_worker_rss_mb"] / peer_mem["largest_worker_rss_mb"], 3)
    result["total_pss_ratio"] = round(mine["idle_memory"]["total_pss_mb"] / peer["idle_memory"]["total_pss_mb"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one-line JSON")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, default=8, help="requests per level (at least 2 per concurrent stream)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=8000, help="each server in turn listens here (loopback)")
    p.add_argument("--peer-venv", type=Path, default=DEFAULT_VENV, help=f"scratch venv with {XLLAMACPP}")
    p.add_argument("--peer-threads", type=int, default=None, help="llama.cpp threads (default: every core)")
    p.add_argument("--peer-slots", type=int, default=None, help="llama.cpp parallel slots (default: max concurrency)")
    p.add_argument("--order", default="pdserve,llama_cpp", help="which server runs first")
    p.add_argument("--idle-s", type=float, default=5.0, help="quiet seconds before memory is read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", choices=["none", "auto", "int8", "int4"], default=None,
                   help="pdserve serve --quantization (default: not passed, pdserve's defaults)")
    args = p.parse_args(argv)
    if sorted(args.order.split(",")) != ["llama_cpp", "pdserve"]:
        p.error("--order must name pdserve and llama_cpp once each")
    try:
        result = run(args)
    except (RuntimeError, OSError) as exc:
        print(f"pdserve bench peer: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=None if args.json else 2))
    return 0
