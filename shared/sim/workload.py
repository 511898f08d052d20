"""Simulated arrivals from the load tests' own workloads and arrival processes (pdserve.loadtest):
the same seed gives the same prompt and output lengths, and the same arrival times, as a live run."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np
from pdserve.loadtest.arrivals import arrival_process
from pdserve.loadtest.distributions import LengthDist
from pdserve.loadtest.runner import LoadConfig, run_seed
from pdserve.loadtest.workloads import Mooncake, Synthetic, Workload
from pdserve.sim.config import SimRequest

HASH_STRIDE = 1 << 16  # engine-block hash of trace block h, part j: h * HASH_STRIDE + j


def synthetic(prompt: LengthDist, output: LengthDist, schedule: Sequence[float], seed: int) -> list[SimRequest]:
    """Lengths drawn as Synthetic.requests draws them (prompts, then outputs, from one generator)."""
    rng = np.random.default_rng(seed)
    n = len(schedule)
    prompts, outputs = prompt.sample(rng, n), output.sample(rng, n)
    return [SimRequest(i, t, p, o) for i, (t, p, o) in enumerate(zip(schedule, prompts, outputs))]


def trace_hashes(hash_ids: Sequence[int], prompt_tokens: int, trace_block: int, engine_block: int) -> tuple[int, ...]:
    """A Mooncake record's hash ids (one per `trace_block` tokens, prefix-chained) as engine-block hashes."""
    if trace_block % engine_block:
        raise ValueError(f"trace block size {trace_block} is not a multiple of the engine's {engine_block}")
    per = trace_block // engine_block
    full = prompt_tokens // engine_block
    return tuple(h * HASH_STRIDE + j for h in hash_ids for j in range(per))[:full]


def mooncake(work: Mooncake, schedule: Sequence[float], engine_block: int) -> list[SimRequest]:
    out = []
    for i, (t, record) in enumerate(zip(schedule, work.records(len(schedule)))):
        prompt, output = work.lengths(record)
        hashes = trace_hashes(record.get("hash_ids") or (), prompt, work.block_size, engine_block)
        out.append(SimRequest(i, t, prompt, output, hashes))
    return out


def requests_for(work: Workload, load: LoadConfig, rate: float | None, engine_block: int = 16) -> list[SimRequest]:
    """One load point's requests, as `pdserve.loadtest.runner.run_point` builds them (seeded by rate)."""
    seed = run_seed(load.seed, rate)
    if load.arrival == "trace":
        trace = work.arrivals(load.num_requests)
        if trace is None:
            raise ValueError("arrival 'trace' needs a workload with timestamps (mooncake)")
        process = dataclasses.replace(trace, rate=rate)
    else:
        if rate is None:
            raise ValueError("an open-loop run needs a rate")
        options = {"burstiness": load.burstiness} if load.arrival == "gamma" else {}
        process = arrival_process(load.arrival, rate, **options)
    schedule = process.schedule(load.num_requests, seed)
    if isinstance(work, Synthetic):
        return synthetic(work.prompt, work.output, schedule, seed)
    if isinstance(work, Mooncake):
        return mooncake(work, schedule, engine_block)
    raise ValueError(f"the simulator replays synthetic and mooncake workloads, not {type(work).__name__}")


def load_trace(path: str, trace_block: int | None = None, engine_block: int = 16) -> list[SimRequest]:
    """A JSONL trace: one object a line with `timestamp` (ms) or `arrival_s`, `input_length` and
    `output_length` (Mooncake); with `trace_block`, its `hash_ids` (one per that many tokens) give the
    prompts' shared prefixes."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    for n, line in enumerate(filter(str.strip, lines), 1):
        try:
            row = json.loads(line)
            t = float(row["arrival_s"]) if "arrival_s" in row else float(row["timestamp"]) / 1e3
            prompt = int(row["input_length"])
            hashes = () if trace_block is None else trace_hashes(row.get("hash_ids") or (), prompt, trace_block,
                                                                engine_block)
            out.append(SimRequest(len(out), t, prompt, max(1, int(row["output_length"])), hashes))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a trace record ({type(exc).__name__}: {exc})") from None
    if not out:
        raise ValueError(f"{path}: no trace records")
    start = min(r.arrival_s for r in out)
    return [dataclasses.replace(r, arrival_s=r.arrival_s - start) for r in out]


