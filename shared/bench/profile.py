"""`pdserve profile`: measure an engine's prefill and decode step times and fit a `LatencyModel`.

Prefill samples: one request of n fresh tokens (max_tokens=1) in one step, wall time of `step()`;
with a cached prefix, the prefix runs first so the block manager hits it, and the sample records the
tokens actually hit. Decode samples: a batch of B requests of context L, then the mean of a few
pure-decode steps, recorded with the batch's total context at those steps. Each grid point is
measured `repeats` times, interleaved, and fitted at its median.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.model_runner import kv_block_bytes
from pdserve.engine.outputs import GenerationRequest
from pdserve.latency_model import DecodeModel, LatencyModel, PrefillModel, TransferModel
from pdserve.sampling_params import SamplingParams

# cached prefixes up to 1024 tokens: fitted on 256 alone, the n x cached term priced 512 new tokens behind
# 1120 cached at 0.6x their measured time (random h512 Llama, one thread, 2026-11-29)
QUICK = {"prompt_lengths": (16, 64, 128, 256, 512, 1024), "cached_prefixes": (256, 1024),
         "batch_sizes": (1, 4, 16, 32), "context_lengths": (64, 256, 512), "repeats": 3, "decode_steps": 3}
FULL = {"prompt_lengths": (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2000),
        "cached_prefixes": (256, 768, 1536), "batch_sizes": (1, 2, 4, 8, 16, 32, 48, 64),
        "context_lengths": (32, 128, 256, 512, 1024), "repeats": 3, "decode_steps": 4}


DECODE_SLACK = 8  # output tokens beyond the timed steps, so no sequence finishes inside them


def _log(message: str) -> None:
    print(f"[profile] {message}", file=sys.stderr, flush=True)


class Prober:
    def __init__(self, engine: LLMEngine, seed: int) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.vocab = engine.model_config.vocab_size
        self.counter = 0

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        request_id = f"profile-{self.counter}"
        self.counter += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(GenerationRequest(request_id, tuple(prompt), params))
        return request_id

    def timed_step(self) -> tuple[float, list]:
        start = time.perf_counter()
        deltas = self.engine.step()
        return time.perf_counter() - start, deltas

    def _until_decoding(self) -> None:
        scheduler = self.engine.scheduler
        while scheduler.num_waiting or any(not s.is_decoding for s in scheduler.running):
            self.engine.step()

    def drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def prefill(self, new_tokens: int, prefix: list[int] | None = None) -> tuple[int, int, float]:
        """(new tokens, cached tokens, seconds) of one prefill step."""
        self.add(list(prefix or []) + self.tokens(new_tokens), 1)
        seconds, deltas = self.timed_step()
        self.drain()
        cached = deltas[0].num_cached_tokens if deltas else 0
        return len(prefix or []) + new_tokens - cached, cached, seconds

    def decode(self, batch: int, context: int, steps: int) -> tuple[int, int, float]:
        """(batch, total context tokens, mean seconds per step) over `steps` pure-decode steps.

        The batch shares one prompt: the first request's full blocks are cached before the others
        arrive, so setting up a batch costs one prefill, while every sequence still reads its whole
        context each step."""
        prompt = self.tokens(context)
        ids = [self.add(prompt, steps + DECODE_SLACK)]
        self._until_decoding()
        ids += [self.add(prompt, steps + DECODE_SLACK) for _ in range(batch - 1)]
        self._until_decoding()
        running = self.engine.scheduler.running
        total_context = sum(len(s) for s in running)
        times = [self.timed_step()[0] for _ in range(steps)]
        for request_id in ids:
            self.engine.abort(request_id)
        return batch, total_context + batch * (steps - 1) // 2, sum(times) / len(times)


def profile(
    engine_config: EngineConfig,
    prompt_lengths: Sequence[int],
    batch_sizes: Sequence[int],
    context_lengths: Sequence[int] = (64, 256, 512),
    cached_prefixes: Sequence[int] = (256,),
    repeats: int = 2,
    decode_steps: int = 3,
    transfer_samples: Mapping[str, Sequence[tuple[int, float]]] | None = None,
    seed: int = 0,
) -> LatencyModel:
    """Fit prefill and decode models for `engine_config` from measurements on a fresh engine."""
    block = engine_config.cache.block_size
    longest_cached = max((p + n for p in cached_prefixes for n in prompt_lengths if n <= p), default=0)
    longest = max(max(prompt_lengths), longest_cached, max(context_lengths) + decode_steps + DECODE_SLACK)
    # a decode batch shares its prompt's full blocks; each sequence adds a partial block and its outputs
    per_sequence = 2 * block + decode_steps + DECODE_SLACK
    pool_tokens = max(longest, max(context_lengths) + max(batch_sizes) * per_sequence) + longest + 4 * block
    config = dataclasses.replace(
        engine_config,
        cache=dataclasses.replace(
            engine_config.cache, num_blocks=-(-pool_tokens // block), enable_prefix_caching=True
        ),
        scheduler=dataclasses.replace(
            engine_config.scheduler, max_num_seqs=max(max(batch_sizes), engine_config.scheduler.max_num_seqs),
            max_num_batched_tokens=max(longest, engine_config.scheduler.max_num_batched_tokens),
        ),
    )
    engine = LLMEngine(config)
    prober = Prober(engine, seed)
    # warm-up at the largest shapes: the first touch of fresh buffers is slow here
    prober.prefill(max(prompt_lengths))
    prober.decode(max(batch_sizes), max(context_lengths), 1)
    prefill_samples = []
    for _ in range(repeats):
        for n in prompt_lengths:
            prefill_samples.append(prober.prefill(n))
        for prefix_len in cached_prefixes:
            prefix = prober.tokens(prefix_len)
            prober.prefill(0, prefix)  # caches the prefix's full blocks
            for n in prompt_lengths:
                if n <= prefix_len and prefix_len + n < engine.max_model_len:  # room for the one output token
                    prefill_samples.append(prober.prefill(n, prefix))
    _log(f"{len(prefill_samples)} prefill samples")
    decode_samples = [
        prober.decode(b, ctx, decode_steps)
        for _ in range(repeats) for b in batch_sizes for ctx in context_lengths
    ]
    _log(f"{len(decode_samples)} decode samples")
    return LatencyModel(
        prefill=PrefillModel.fit(_median_per_point(prefill_samples)),
        decode=DecodeModel.fit(_median_per_point(decode_samples)),
        kv_bytes_per_token=kv_block_bytes(engine.model_config, 1, config.torch_dtype),
        transfers={name: TransferModel.fit(s) for name, s in (transfer_samples or {}).items()},
    )


def _median_per_point(samples: list[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """One sample per grid point: the median time over its repeats (this VM's timings jitter ~15%)."""
    times: dict[tuple[int, int], list[float]] = {}
    for x, y, t in samples:
        times.setdefault((x, y), []).append(t)
    return [(x, y, statistics.median(ts)) for (x, y), ts in times.items()]


def run(model: str = "tiny", quick: bool = False, device: str | None = None, dtype: str | None = None,
        transfer_samples: Mapping[str, Sequence[tuple[int, float]]] | None = None) -> LatencyModel:
    grid = QUICK if quick else FULL
    overrides = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    config = EngineConfig(model=model, cache=CacheConfig(block_size=16), **overrides)
    return profile(config, transfer_samples=transfer_samples, **grid)
