"""`pdserve plan --measure`: the plan's per-replica predictions against this machine, same model.

One mean prompt is prefilled alone (the plan's prefill time), and a batch of the plan's decode size
at the mean context is stepped (the plan's decode step); each is the median of `repeats` runs.
"""

from __future__ import annotations

import statistics
from typing import Any

from pdserve.bench.profile import Prober
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.latency_model import LatencyModel
from pdserve.plan import Plan, PlanInput


def measure(model: str, p: Plan, inp: PlanInput, prefill: LatencyModel, decode: LatencyModel,
            max_batch: int = 64, repeats: int = 3, decode_steps: int = 3) -> dict[str, Any]:
    """Predicted and measured prefill and decode figures, with measured / predicted ratios."""
    batch = max(1, min(p.decode_batch or 1, max_batch))
    context = inp.prompt_tokens + inp.output_tokens // 2
    block = inp.block_size
    pool_tokens = batch * (context + 2 * block + decode_steps + 8) + inp.prompt_tokens + 8 * block
    engine = LLMEngine(EngineConfig(
        model=model, dtype=inp.dtype,
        cache=CacheConfig(block_size=block, num_blocks=-(-pool_tokens // block), enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=max(batch, 8),
                                  max_num_batched_tokens=max(inp.prompt_tokens, context, 2048)),
    ))
    prober = Prober(engine, seed=0)
    prober.prefill(inp.prompt_tokens)  # warm-up
    prefill_s = statistics.median(prober.prefill(inp.prompt_tokens)[2] for _ in range(repeats))
    runs = [prober.decode(batch, context, decode_steps) for _ in range(repeats)]
    step_s = statistics.median(r[2] for r in runs)
    total_context = statistics.median(r[1] for r in runs)
    predicted_step = decode.decode_step_s(batch, total_context)
    predicted_prefill = prefill.prefill_time_s(inp.prompt_tokens)
    return {
        "prompt_tokens": inp.prompt_tokens, "decode_batch": batch, "decode_context_tokens": total_context,
        "prefill_s": {"predicted": predicted_prefill, "measured": prefill_s, "ratio": prefill_s / predicted_prefill},
        "prefill_tokens_s": {"predicted": inp.prompt_tokens / predicted_prefill,
                             "measured": inp.prompt_tokens / prefill_s},
        "decode_step_s": {"predicted": predicted_step, "measured": step_s, "ratio": step_s / predicted_step},
        "decode_tokens_s": {"predicted": batch / predicted_step, "measured": batch / step_s},
        "plan_decode_batch": p.decode_batch,
        **({"note": f"decode measured at batch {batch}, below the plan's {p.decode_batch}"}
           if p.decode_batch > batch else {}),
    }


def render(check: dict[str, Any]) -> str:
    pf, dc = check["prefill_s"], check["decode_step_s"]
    lines = [
        f"measured on this machine ({check['prompt_tokens']}-token prefill; decode batch {check['decode_batch']}, "
        f"{check['decode_context_tokens']:.0f} context tokens):",
        f"  prefill {pf['measured'] * 1e3:.1f} ms vs {pf['predicted'] * 1e3:.1f} ms predicted "
        f"(x{pf['ratio']:.2f}), {check['prefill_tokens_s']['measured']:.0f} tok/s",
        f"  decode step {dc['measured'] * 1e3:.1f} ms vs {dc['predicted'] * 1e3:.1f} ms predicted "
        f"(x{dc['ratio']:.2f}), {check['decode_tokens_s']['measured']:.0f} tok/s",
    ]
    return "\n".join(lines + ([f"  note: {check['note']}"] if "note" in check else []))
