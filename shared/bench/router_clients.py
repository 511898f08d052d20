"""The client side of `pdserve bench router`: one request through the direct engine or over HTTP as a
(TTFT, E2E, tokens, messages) sample, closed loops at each concurrency level, and their summaries."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import numpy as np

from pdserve.bench.steps import StepTimes

Sample = tuple[float, float, int, int]  # TTFT s, E2E s, tokens, stream messages


def summary(samples: list[Sample]) -> dict[str, float]:
    ttft = np.array([s[0] for s in samples]) * 1e3
    e2e = np.array([s[1] for s in samples]) * 1e3
    tpot = np.array([(s[1] - s[0]) / max(1, s[2] - 1) for s in samples]) * 1e3
    num_tokens = sum(s[2] for s in samples)

    def pct(values: np.ndarray, q: int) -> float:
        return round(float(np.percentile(values, q)), 3)

    return {
        "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99), "e2e_ms_p50": pct(e2e, 50),
        "e2e_ms_p99": pct(e2e, 99), "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
        "messages_per_token": round(sum(s[3] for s in samples) / max(1, num_tokens), 4),
        "num_requests": len(samples), "_ttft_ms": ttft.tolist(),  # raw TTFTs, popped by run()
    }


async def closed_loop(one, prompts: list[list[int]], concurrency: int) -> list[tuple[int, Sample]]:
    """(request index, sample) for every prompt, `concurrency` requests in flight at a time."""
    queue: asyncio.Queue = asyncio.Queue()
    for i, prompt in enumerate(prompts):
        queue.put_nowait((i, prompt))
    samples: list[tuple[int, Sample]] = []

    async def worker() -> None:
        while not queue.empty():
            i, prompt = queue.get_nowait()
            samples.append((i, await one(i, prompt)))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples


def alternating(ones: list):
    """Request i goes to ones[i % len(ones)]: paths measured side by side share the machine's drift."""
    async def one(i: int, prompt: list[int]) -> Sample:
        return await ones[i % len(ones)](i, prompt)

    return one


def direct_one(engine, max_tokens: int):
    from pdserve.engine.outputs import GenerationRequest
    from pdserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> Sample:
        start = time.perf_counter()
        ttft = None
        num_tokens = num_deltas = 0
        async for delta in engine.generate(GenerationRequest(f"direct-{i}-{random.random()}", tuple(prompt), params)):
            ttft = ttft if ttft is not None else time.perf_counter() - start
            num_tokens += len(delta.token_ids)
            num_deltas += 1
        return ttft, time.perf_counter() - start, num_tokens, num_deltas

    return one


def http_one(client, url: str, max_tokens: int, model: str):
    async def one(i: int, prompt: list[int]) -> Sample:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        ttft = None
        num_chunks = num_tokens = 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {await resp.aread()!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    num_chunks += 1
                elif chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
        if num_tokens != max_tokens:
            raise RuntimeError(f"expected {max_tokens} tokens, the usage chunk says {num_tokens}")
        return ttft, time.perf_counter() - start, num_tokens, num_chunks

    return one


async def levels(
    one, prompts: list[list[int]], concurrencies: list[int], num_requests: int, ways: int = 1,
    steps: StepTimes | None = None,
) -> list[dict[str, Any]]:
    """A warm-up, then a closed loop at each concurrency level over max(num_requests, 4c) requests per
    way; with `ways` > 1 (an `alternating` one), one summary per way. `steps` is told the level."""
    await closed_loop(one, prompts[:4 * ways], 1)
    out: list[dict[str, Any]] = [{} for _ in range(ways)]
    for c in concurrencies:
        if steps is not None:
            steps.level = c
        n = max(num_requests, 4 * c) * ways
        samples = await closed_loop(one, (prompts * (n // len(prompts) + 1))[:n], c)
        for k in range(ways):
            out[k][str(c)] = summary([x for i, x in samples if i % ways == k])
    return out
