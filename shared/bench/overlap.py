"""KV transfer overlapped with prefill, measured as users run it: `pdserve serve` (the default model) with the
whole KV moved after prefill, then with it moved in parts while prefill runs (router kv_part_tokens), on each
KV path; 2k-token prompts one at a time.

`exposed_transfer_fraction`: the transfer time decode waited for once prefill had ended, over the whole
transfer time, summed over the requests (decode's pdserve_kv_transfer_exposed_seconds and
pdserve_kv_transfer_seconds, read from /metrics). In pdserve the first token comes from prefill and reaches
the client without waiting for the transfer: the exposed time delays the second token. So each run also
gives TTFT and the first inter-token gap (first to second token), p50, client side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pdserve.bench.peer_servers import PdserveServer

PATHS = {"shm": {}, "ucx": {"prefill": {"kv_same_host": False}, "decode": {"kv_same_host": False}}}
SERIES = ("pdserve_kv_transfer_exposed_seconds", "pdserve_kv_transfer_seconds")


def _log(message: str) -> None:
    print(f"[bench overlap] {message}", file=sys.stderr, flush=True)


def scrape(url: str) -> dict[str, float]:
    """The sums and counts of the two transfer histograms over every replica and path."""
    import httpx

    totals = dict.fromkeys([f"{s}_{k}" for s in SERIES for k in ("sum", "count")], 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        match = re.match(r"^(pdserve_kv_transfer_(?:exposed_)?seconds_(?:sum|count))(?:\{[^}]*\})? (\S+)$", line)
        if match and match.group(1) in totals:
            totals[match.group(1)] += float(match.group(2))
    return totals


async def _one(client, url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, float]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    arrivals = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                arrivals.append(time.perf_counter() - start)
    if len(arrivals) < 2:
        raise RuntimeError(f"expected {max_tokens} tokens in separate chunks, got {len(arrivals)} chunks")
    return {"ttft": arrivals[0], "first_gap": arrivals[1] - arrivals[0]}


def _p50(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def measure(path: str, part_tokens: int | None, num_requests: int, prompt_tokens: int, port: int,
            seed: int) -> dict[str, Any]:
    import httpx
    from pdserve.models.resolve import DEFAULT_MODEL

    config = dict(PATHS[path]) | {"router": {"kv_part_tokens": part_tokens}}  # None: the whole KV after prefill
    rng = random.Random(seed)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="pdserve-overlap-") as f:
        json.dump(config, f)  # JSON is YAML
        f.flush()
        server = PdserveServer(port, DEFAULT_MODEL, config=Path(f.name))
        with server:
            server.wait_ready()
            prompts = [[rng.randrange(100, 49152) for _ in range(prompt_tokens)] for _ in range(num_requests + 1)]

            async def run() -> list[dict[str, float]]:
                async with httpx.AsyncClient(timeout=600) as client:
                    await _one(client, server.url, server.model, prompts[0], 4)  # warm-up: connections, first pulls
                    before = scrape(server.url)
                    rows = [await _one(client, server.url, server.model, p, 4) for p in prompts[1:]]
                    return rows, before, scrape(server.url)

            rows, before, after = asyncio.run(run())
    delta = {k: after[k] - before[k] for k in after}
    exposed, whole = delta["pdserve_kv_transfer_exposed_seconds_sum"], delta["pdserve_kv_transfer_seconds_sum"]
    return {
        "path": path, "kv_part_tokens": part_tokens, "num_requests": len(rows),
        "num_transfers": int(delta["pdserve_kv_transfer_seconds_count"]),
        "exposed_transfer_fraction": round(exposed / whole, 3) if whole else None,
        "exposed_ms_mean": round(1e3 * exposed / max(1, len(rows)), 2),
        "transfer_ms_mean": round(1e3 * whole / max(1, len(rows)), 2),
        "ttft_ms_p50": round(1e3 * _p50([r["ttft"] for r in rows]), 1),
        "first_gap_ms_p50": round(1e3 * _p50([r["first_gap"] for r in rows]), 1),
        "settings": server.settings | {"config": config},
    }


def run(paths: list[str] | None = None, num_requests: int = 8, prompt_tokens: int = 2000, part_tokens: int = 256,
        port: int = 8000, seed: int = 0) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "overlap", "prompt_tokens": prompt_tokens, "kv_part_tokens": part_tokens,
                              "concurrency": 1, "runs": []}
    for path in paths or list(PATHS):
        for parts in (None, part_tokens):
            _log(f"{path}, {'parts of ' + str(parts) if parts else 'whole KV after prefill'}")
            row = measure(path, parts, num_requests, prompt_tokens, port, seed)
            _log(json.dumps(row))
            result["runs"].append(row)
        off, on = result["runs"][-2:]
        result[f"{path}_exposed_transfer_fraction"] = on["exposed_transfer_fraction"]
        result[f"{path}_ttft_ratio_on_off"] = round(on["ttft_ms_p50"] / off["ttft_ms_p50"], 3)
        result[f"{path}_first_gap_ratio_on_off"] = round(on["first_gap_ms_p50"] / off["first_gap_ms_p50"], 3)
    first = (paths or list(PATHS))[0]
    result["exposed_transfer_fraction"] = result[f"{first}_exposed_transfer_fraction"]  # the default path's
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one-line JSON")
    p.add_argument("--paths", default="shm,ucx", help="comma-separated: shm (the default on one host), ucx")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--part-tokens", type=int, default=256)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    result = run(args.paths.split(","), args.requests, args.prompt_tokens, args.part_tokens, args.port, args.seed)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
