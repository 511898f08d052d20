"""`pdserve bench spec`: speculative (n-gram) decoding against plain decoding, same model, same run.

Two engines, one with drafts (SpeculativeConfig's defaults) and one without, take turns request by
request (batch 1), then run one batch of 16 each. Speedups are ratios of generated tokens per second; every request is greedy,
so all engines must produce the same tokens (`greedy_identical`).
"""

from __future__ import annotations

import sys
import time

import torch

from pdserve.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import GenerationRequest
from pdserve.models.resolve import served_model_name
from pdserve.sampling_params import SamplingParams

DEFAULT_MODEL = "smollm2-135m-instruct"

_CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            result.append(total / window)
    return result'''

_LIST = """- apples: 3 crates, aisle 4
- bananas: 7 crates, aisle 2
- cherries: 2 crates, aisle 9
- dates: 5 crates, aisle 1
- figs: 4 crates, aisle 6
- grapes: 8 crates, aisle 3"""

_DOC = """The Riverside library opens at 9 am on weekdays and at 10 am on Saturdays. It is closed on Sundays.
Members may borrow up to six books at a time for three weeks. Overdue books cost 20 cents per day.
The reading room on the second floor is quiet and has forty desks with power outlets."""

REPETITIVE = [
    f"Rewrite this Python function, renaming the variable `total` to `running_sum`. Change nothing else.\n\n{_CODE}",
    f"Repeat this inventory list exactly, but fix the bananas line to say 9 crates.\n\n{_LIST}",
    f"Here is a notice:\n\n{_DOC}\n\nCopy the notice word for word, changing only 'six books' to 'eight books'.",
    f"Add a docstring to this function and return the full function.\n\n{_CODE}",
]

OPEN = [
    "What are three good habits for staying healthy?",
    "Write a short poem about the sea.",
    "Explain why the sky is blue to a ten year old.",
    "Give me some ideas for a birthday party.",
]


def _log(message: str) -> None:
    print(f"[bench spec] {message}", file=sys.stderr, flush=True)


def _engine(model: str, speculative: SpeculativeConfig | None, pack_weights: bool) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model, device="cpu", dtype="float32", num_threads=1, speculative=speculative, pack_weights=pack_weights,
        scheduler=SchedulerConfig(max_num_seqs=32, max_model_len=2048),
    ))


def _generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[list[list[int]], float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, prompt in enumerate(prompts):
        engine.add_request(GenerationRequest(f"{tag}-{i}", prompt, params))
    outputs: dict[str, list[int]] = {f"{tag}-{i}": [] for i in range(len(prompts))}
    start = time.perf_counter()
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.token_ids)
    return [outputs[f"{tag}-{i}"] for i in range(len(prompts))], time.perf_counter() - start


def _counters(engine: LLMEngine) -> tuple[int, int, int]:
    return engine.num_draft_tokens, engine.num_accepted_tokens, engine.num_verifications


def _compare(plain: LLMEngine, spec: LLMEngine, batches: list[list[list[int]]], max_tokens: int) -> dict:
    """Alternate the engines batch by batch (the order flips each time); tokens/s of each, and spec's counters."""
    seconds, tokens, identical = {"plain": 0.0, "spec": 0.0}, {"plain": 0, "spec": 0}, True
    drafted0, accepted0, verifications0 = _counters(spec)
    for n, prompts in enumerate(batches):
        results = {}
        order = [("plain", plain), ("spec", spec)] if n % 2 == 0 else [("spec", spec), ("plain", plain)]
        for name, engine in order:
            out, elapsed = _generate(engine, prompts, max_tokens, f"{name}{n}")
            results[name] = out
            seconds[name] += elapsed
            tokens[name] += sum(len(o) for o in out)
        identical &= results["plain"] == results["spec"]
    drafted, accepted, verifications = (a - b for a, b in zip(_counters(spec), (drafted0, accepted0, verifications0)))
    return {
        "speedup": (tokens["spec"] / seconds["spec"]) / (tokens["plain"] / seconds["plain"]),
        "tok_s_plain": tokens["plain"] / seconds["plain"],
        "tok_s_spec": tokens["spec"] / seconds["spec"],
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted": accepted / verifications if verifications else 0.0,
        "draft_tokens": drafted,
        "identical": identical,
    }


def run(
    quick: bool = False, model: str | None = None, speculative: SpeculativeConfig | None = None,
    pack_weights: bool = True,
) -> dict:
    model = model or DEFAULT_MODEL
    speculative = speculative or SpeculativeConfig()
    torch.manual_seed(0)
    _log(f"loading {model} twice (with and without speculation)")
    plain, spec = _engine(model, None, pack_weights), _engine(model, speculative, pack_weights)
    tok = plain.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)

    repetitive, open_ended = [chat(p) for p in REPETITIVE], [chat(p) for p in OPEN]
    if quick:
        repetitive, open_ended = repetitive[:2], open_ended[:2]
    max_tokens = 48 if quick else 96
    _generate(plain, [repetitive[0]], 4, "warm")
    _generate(spec, [repetitive[0]], 4, "warm")
    _log("batch 1, repetitive")
    rep = _compare(plain, spec, [[p] for p in repetitive], max_tokens)
    _log("batch 1, open-ended")
    opn = _compare(plain, spec, [[p] for p in open_ended], max_tokens)
    _log("batch 16, repetitive")
    batch = [repetitive[i % len(repetitive)] for i in range(16)]
    b16 = _compare(plain, spec, [batch], max_tokens // 2 if quick else 64)
    return {
        "model": served_model_name(model),
        "method": speculative.method,
        "num_speculative_tokens": speculative.num_speculative_tokens,
        "prompt_lookup": [speculative.prompt_lookup_min, speculative.prompt_lookup_max],
        "max_tokens": max_tokens,
        "pack_weights": pack_weights,
        "speedup_repetitive_b1": round(rep["speedup"], 3),
        "speedup_open_b1": round(opn["speedup"], 3),
        "speedup_repetitive_b16": round(b16["speedup"], 3),
        "acceptance_rate_repetitive": round(rep["acceptance_rate"], 3),
        "acceptance_rate_open": round(opn["acceptance_rate"], 3),
        "tok_s_repetitive_b1": {"plain": round(rep["tok_s_plain"], 1), "spec": round(rep["tok_s_spec"], 1)},
        "tok_s_open_b1": {"plain": round(opn["tok_s_plain"], 1), "spec": round(opn["tok_s_spec"], 1)},
        "tok_s_repetitive_b16": {"plain": round(b16["tok_s_plain"], 1), "spec": round(b16["tok_s_spec"], 1)},
        "mean_accepted_tokens_repetitive": round(rep["mean_accepted"], 2),
        "greedy_identical": all(r["identical"] for r in (rep, opn, b16)),
        "targets": {"speedup_repetitive_b1": 1.8, "speedup_open_b1": 0.95},
    }
