"""`roofline_fraction_b1` from paired measurements, for `pdserve bench engine`.

The read bandwidth a VM gets moves within seconds: on a 2-core AMD EPYC VM (2026-11-29) one 1 GiB buffer,
summed every two seconds, read at 42.7, 66.1, 39.6, 43.3, 43.6, 41.4, 73.5 and 69.1 GB/s. A decode rate
timed minutes away from a bandwidth reading compares two different machines. So each round reads the
bandwidth just before and just after one b1 request's decode steps (the same buffer, no allocation between),
and divides that request's decode rate times the bytes a step reads by the higher of its two readings. The
figure is the median over the rounds; the rounds' own figures and readings come with it. llama.cpp's runs
in the same bench are read the same way (pdserve.bench.engine_peer takes the probe).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from pdserve.bench.roofline import tensor_read_gb_s
from pdserve.engine import LLM
from pdserve.engine.llm_engine import GenerationRequest
from pdserve.sampling_params import SamplingParams


def decode_steps_tok_s(llm: LLM, prompt: list[int], max_tokens: int, request_id: str) -> float:
    """One request through the engine's step loop: its decode steps' tokens over their time (the steps up to
    its first token, the prefill, left out)."""
    engine = llm.engine
    engine.add_request(GenerationRequest(
        request_id, tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    decode_steps, prefilled = [], False
    while engine.has_unfinished():
        start = time.perf_counter()
        deltas = engine.step()
        if prefilled:
            decode_steps.append(time.perf_counter() - start)
        prefilled = prefilled or any(d.request_id == request_id and d.token_ids for d in deltas)
    return len(decode_steps) / sum(decode_steps)


def bandwidth_probe(probe_bytes: int = 1 << 30) -> Callable[[], float]:
    """A reading of the read bandwidth on one buffer allocated now (no allocation between readings)."""
    buffer = torch.ones(probe_bytes // 4, dtype=torch.float32)
    return lambda: tensor_read_gb_s(buffer, 3)


def paired_fractions(runs: list[dict], step_bytes: int) -> dict:
    """runs: {"decode_tok_s", "bw_gb_s": [before, after]} each; each run's fraction against its higher
    reading, and their median, min and max."""
    for run in runs:
        run["fraction"] = round(run["decode_tok_s"] * step_bytes / 1e9 / max(run["bw_gb_s"]), 3)
    fractions = [run["fraction"] for run in runs]
    return {"median": round(statistics.median(fractions), 3), "min": min(fractions), "max": max(fractions),
            "rounds": runs}


def paired_roofline(llm: LLM, prompt: list[int], max_tokens: int, step_bytes: int, probe: Callable[[], float],
                    rounds: int = 7) -> dict:
    """Per round: bandwidth, one request's decode rate, bandwidth."""
    if rounds < 1 or max_tokens < 2:
        raise ValueError("paired_roofline needs at least one round and two output tokens")
    runs = []
    for r in range(rounds):
        before = probe()
        tok_s = decode_steps_tok_s(llm, prompt, max_tokens, f"bench-paired-{r}")
        runs.append({"decode_tok_s": round(tok_s, 2), "bw_gb_s": [round(before, 2), round(probe(), 2)]})
    return paired_fractions(runs, step_bytes)
