"""`pdserve bench structured`: what a json_schema costs decoding, and how often sampled outputs validate.

On the default model (SmolLM2-135M-Instruct, fp32, CPU), in one engine:
- **decode step time** with every sequence under a json_schema against the same batch unconstrained
  (`ignore_eos`), at batch 1 and 16, interleaved rounds, steps timed only while the whole batch decodes;
  the figure is the ratio of medians (target at batch 16: <= 1.10);
- **grammar compile time**, cold (a schema the cache has not seen) and cached;
- **validity**: NUM_SCHEMAS schemas x seeds at temperature 1, every output parsed and checked with
  `jsonschema`; an output cut by max_tokens counts as invalid (reported apart).
Prints one JSON object.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from pdserve.bench.structured_schemas import LONG_SCHEMA, SCHEMAS, prompt_for

MAX_TOKENS = 192


def _engine(max_num_seqs: int):
    from pdserve.config import EngineConfig, SchedulerConfig
    from pdserve.engine import LLMEngine
    from pdserve.models.resolve import DEFAULT_MODEL

    return LLMEngine(EngineConfig(model=DEFAULT_MODEL, device="cpu", dtype="float32",
                                  scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=max_num_seqs)))


def _ids(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def _step_times(engine, batch: int, schema: str | None, num_steps: int, tag: str) -> list[float]:
    """Wall time of each engine step while all `batch` sequences decode (prefill steps left out)."""
    from pdserve.engine import GenerationRequest
    from pdserve.sampling_params import SamplingParams

    prompt = _ids(engine, prompt_for(json.loads(LONG_SCHEMA)))
    for i in range(batch):
        params = SamplingParams(max_tokens=num_steps + 1, temperature=1.0, seed=i, ignore_eos=schema is None,
                                json_schema=schema)
        engine.add_request(GenerationRequest(f"{tag}-{i}", prompt, params))
    times, generated = [], 0
    while engine.has_unfinished():
        running = engine.scheduler.num_running
        start = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - start
        generated += sum(len(d.token_ids) for d in deltas)
        if running == batch and generated > batch and len(deltas) == batch:  # a pure decode step of the whole batch
            times.append(elapsed)
    return times


def decode_cost(engine, batches: tuple[int, ...], rounds: int, num_steps: int) -> dict[str, Any]:
    from pdserve.structured import canonical_schema

    schema = canonical_schema(json.loads(LONG_SCHEMA))
    out = {}
    for batch in batches:
        free, guided = [], []
        for r in range(rounds):  # interleaved, so drift on a shared machine hits both
            free += _step_times(engine, batch, None, num_steps, f"free-{batch}-{r}")
            guided += _step_times(engine, batch, schema, num_steps, f"guided-{batch}-{r}")
        out[str(batch)] = {
            "unconstrained_step_ms_p50": round(statistics.median(free) * 1e3, 3),
            "json_schema_step_ms_p50": round(statistics.median(guided) * 1e3, 3),
            "tpot_ratio": round(statistics.median(guided) / statistics.median(free), 4),
            "num_steps": {"unconstrained": len(free), "json_schema": len(guided)},
        }
    return out


def compile_times(engine) -> dict[str, float]:
    """Cold: each schema the first time (a fresh cache entry); cached: the same schema again."""
    from pdserve.structured import canonical_schema

    start = time.perf_counter()
    grammars = engine.grammars  # the tokenizer's index, built once per engine on the first constrained request
    index_s = time.perf_counter() - start
    cold, cached = [], []
    for i, schema in enumerate(SCHEMAS):
        text = canonical_schema({**schema, "title": f"bench-{time.time_ns()}-{i}"})  # never seen before
        start = time.perf_counter()
        grammars.grammar(text)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        grammars.grammar(text)
        cached.append(time.perf_counter() - start)
    return {"cold_ms_p50": round(statistics.median(cold) * 1e3, 3), "cold_ms_max": round(max(cold) * 1e3, 3),
            "cached_us_p50": round(statistics.median(cached) * 1e6, 2), "token_index_ms": round(index_s * 1e3, 1),
            "num_schemas": len(cold)}


def validity(engine, seeds: int) -> dict[str, Any]:
    import jsonschema

    from pdserve.engine import GenerationRequest
    from pdserve.sampling_params import SamplingParams
    from pdserve.structured import canonical_schema

    texts: dict[str, list[str]] = {}
    reasons: dict[str, str | None] = {}
    for k, schema in enumerate(SCHEMAS):
        prompt = _ids(engine, prompt_for(schema))
        for s in range(seeds):
            rid = f"v{k}-{s}"
            engine.add_request(GenerationRequest(rid, prompt, SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, seed=s, json_schema=canonical_schema(schema))))
            texts[rid] = []
    while engine.has_unfinished():
        for delta in engine.step():
            texts[delta.request_id].append(delta.text)
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
    valid, truncated, failures = 0, [], []
    for rid, parts in texts.items():
        k = int(rid[1:].split("-")[0])
        if reasons.get(rid) == "length":
            truncated.append({"request": rid, "tail": "".join(parts)[-80:]})
            continue
        try:
            jsonschema.validate(json.loads("".join(parts)), SCHEMAS[k])
            valid += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append({"request": rid, "error": str(exc)[:200]})
    n = len(texts)
    return {"num_responses": n, "num_schemas": len(SCHEMAS), "seeds": seeds, "valid": valid,
            "valid_share": round(valid / n, 4), "cut_by_max_tokens": len(truncated), "cut": truncated[:10], "invalid": failures[:10],
            "max_tokens": MAX_TOKENS}


def run(quick: bool = False, seed: int = 0) -> dict[str, Any]:
    import platform

    import torch

    torch.manual_seed(seed)
    batches = (1, 16)
    engine = _engine(max_num_seqs=max(batches))
    result: dict[str, Any] = {"bench": "structured", "model": "smollm2-135m-instruct", "dtype": "float32",
                              "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
                              "backend": engine.config.structured.backend}
    result["compile"] = compile_times(engine)
    result["decode"] = decode_cost(engine, batches, rounds=2 if quick else 3, num_steps=24 if quick else 48)
    result["validity"] = validity(engine, seeds=1 if quick else 10)
    return result
