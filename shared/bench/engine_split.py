"""Where a batch-1 decode step's time goes, for `pdserve bench engine`.

One request runs through the engine's own step loop with the model's `forward` (embedding, every decoder
layer, the final norm) and `compute_logits` (the LM head) timed per step; the rest of a step is the
engine's Python around them (scheduling, metadata, sampling, detokenizing). The first step, the prefill, is
left out. Each part is the median over the decode steps, and its read rate is the bytes that part streams
(pdserve.models.served) over its time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from pdserve.engine import LLM
from pdserve.engine.llm_engine import GenerationRequest
from pdserve.models.served import decode_read_bytes
from pdserve.sampling_params import SamplingParams


def _timed(fn: Callable, key: str, into: dict[str, float]) -> Callable:
    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[key] = into.get(key, 0.0) + time.perf_counter() - start
    return call


def decode_step_split(llm: LLM, prompt: list[int], max_tokens: int, kv_bytes: int) -> dict:
    """Median ms per decode step of the model's forward, the LM head and the rest, and the read rates of
    the first two (`kv_bytes`: the K/V a step reads, counted with the forward)."""
    engine = llm.engine
    model = engine.runner.model
    head_bytes = decode_read_bytes(model.lm_head)
    forward_bytes = decode_read_bytes(model) - head_bytes + kv_bytes
    parts: dict[str, float] = {}
    steps: list[tuple[float, float, float]] = []
    # instance attributes shadow the class's methods for this run only
    model.forward = _timed(model.forward, "forward", parts)
    model.compute_logits = _timed(model.compute_logits, "lm_head", parts)
    try:
        engine.add_request(GenerationRequest(
            "bench-split", tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
        while engine.has_unfinished():
            parts.clear()
            start = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - start, parts.get("forward", 0.0), parts.get("lm_head", 0.0)))
    finally:
        del model.forward, model.compute_logits
    decode = steps[1:]
    step, forward, head = (statistics.median(column) for column in zip(*decode))
    outside = statistics.median(total - f - h for total, f, h in decode)
    return {
        "decode_steps": len(decode),
        "step_ms": round(step * 1e3, 3),
        "forward_ms": round(forward * 1e3, 3),
        "lm_head_ms": round(head * 1e3, 3),
        "outside_ms": round(outside * 1e3, 3),
        "forward_read_gb_s": round(forward_bytes / forward / 1e9, 2),
        "lm_head_read_gb_s": round(head_bytes / head / 1e9, 2),
        "forward_bytes": forward_bytes,
        "lm_head_bytes": head_bytes,
    }
