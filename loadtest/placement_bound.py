"""What placement can save at most on a Mooncake trace, before any run: the prompt tokens a request
finds cached when it lands where its longest cached prefix is, against a cache-blind policy's.

- `ceiling`: one cache that has seen every earlier request (a replica per request chosen with perfect
  knowledge, and no eviction). No placement over any number of replicas hits more.
- `cache_blind`: each request on a replica drawn at random from `num_replicas` (what `least_loaded` and
  `round_robin` get on average when load does not follow the prefix), averaged over `draws` seeded draws.

A hit counts as the engine counts it: whole leading blocks, the prompt's last token always computed.
With a latency profile, each request's model time is its prefill (the uncached tokens after the
cached ones) plus its share of decode steps at a batch size b (its output tokens x step(b) / b, every
sequence at this request's mean context). Placement changes only the prefill; where decode steps are
most of a request's time, no placement buys much capacity. `capacity_ratio` is the mean cache-blind
model time over the mean ceiling time: the most a prefix-aware policy can raise the rate a pool
sustains when compute bounds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.latency_model import LatencyModel, LatencyProfile
from pdserve.loadtest.scenario import Scenario
from pdserve.loadtest.workloads import Mooncake


@dataclass(frozen=True)
class TraceRequest:
    hash_ids: tuple[int, ...]
    input_length: int
    output_length: int

    @classmethod
    def from_record(cls, record: dict[str, Any], trace: Mooncake) -> TraceRequest:
        """As the load sends it (`Mooncake.lengths`)."""
        return cls(tuple(record.get("hash_ids") or ()), *trace.lengths(record))


def hit_tokens(request: TraceRequest, cached: set[tuple[int, ...]], block_size: int) -> int:
    """Leading whole blocks found in `cached` (each block keyed by its prefix of hash ids), at most
    `(input_length - 1) // block_size` of them."""
    hashable = min(len(request.hash_ids), (request.input_length - 1) // block_size)
    n = 0
    while n < hashable and request.hash_ids[: n + 1] in cached:
        n += 1
    return n * block_size


def _store(request: TraceRequest, cache: set[tuple[int, ...]], block_size: int) -> None:
    full = min(len(request.hash_ids), request.input_length // block_size)
    cache.update(request.hash_ids[: k + 1] for k in range(full))


def ceiling_hits(requests: Sequence[TraceRequest], block_size: int) -> list[int]:
    cache: set[tuple[int, ...]] = set()
    hits = []
    for r in requests:
        hits.append(hit_tokens(r, cache, block_size))
        _store(r, cache, block_size)
    return hits


def cache_blind_hits(
    requests: Sequence[TraceRequest], block_size: int, num_replicas: int, draws: int = 200, seed: int = 0,
) -> np.ndarray:
    """[draws, requests]: each draw places every request on a uniformly drawn replica."""
    hits = np.zeros((draws, len(requests)), dtype=np.int64)
    for draw in range(draws):
        rng = np.random.default_rng([seed, draw])
        caches: list[set[tuple[int, ...]]] = [set() for _ in range(num_replicas)]
        for i, (r, k) in enumerate(zip(requests, rng.integers(num_replicas, size=len(requests)))):
            hits[draw, i] = hit_tokens(r, caches[k], block_size)
            _store(r, caches[k], block_size)
    return hits


@dataclass(frozen=True)
class Models:
    prefill: LatencyModel  # the role whose replicas run prefill (decode's own, when colocated)
    decode: LatencyModel


def model_time_s(request: TraceRequest, cached: int, models: Models, batch: int) -> tuple[float, float]:
    """(prefill s, decode s) of one request with `cached` prompt tokens cached, decoding in batches of `batch`."""
    prefill = models.prefill.prefill_time_s(request.input_length - cached, cached)
    context = request.input_length + request.output_length // 2
    decode = request.output_length * models.decode.decode_step_s(batch, batch * context) / batch
    return prefill, decode


def placement_bound(
    requests: Sequence[TraceRequest], block_size: int, num_replicas: int, models: Models | None = None,
    batches: Iterable[int] = (1, 2, 4, 16), draws: int = 200, seed: int = 0,
) -> dict[str, Any]:
    if not requests:
        raise ValueError("the trace has no requests")
    batches = tuple(batches)
    if num_replicas < 1 or draws < 1 or any(b < 1 for b in batches):
        raise ValueError(f"replicas, draws and decode batches must be at least 1, got {num_replicas}, {draws}, "
                         f"{list(batches)}")
    # [placements, requests]: the ceiling is one placement, the cache-blind case `draws` of them
    policies = {"ceiling": np.array([ceiling_hits(requests, block_size)]),
                "cache_blind": cache_blind_hits(requests, block_size, num_replicas, draws, seed)}
    prompt = sum(r.input_length for r in requests)
    computed = {p: prompt - float(h.sum(axis=1).mean()) for p, h in policies.items()}
    out: dict[str, Any] = {
        "requests": len(requests), "block_size": block_size, "num_replicas": num_replicas, "draws": draws,
        "prompt_tokens_per_request": prompt / len(requests),
        "output_tokens_per_request": sum(r.output_length for r in requests) / len(requests),
        "prefix_hit_rate": {p: 1 - c / prompt for p, c in computed.items()},
        "computed_prompt_tokens_per_request": {p: c / len(requests) for p, c in computed.items()},
    }
    if models is None:
        return out
    rows = []
    for batch in batches:
        row: dict[str, Any] = {"decode_batch": batch}
        for name, hits in policies.items():
            times = np.array([[model_time_s(r, int(h), models, batch) for r, h in zip(requests, placed)]
                              for placed in hits])  # [placements, requests, (prefill, decode)]
            prefill, decode = times.mean(axis=(0, 1))
            row[name] = {"prefill_s": float(prefill), "decode_s": float(decode), "total_s": float(prefill + decode)}
        row["capacity_ratio"] = row["cache_blind"]["total_s"] / row["ceiling"]["total_s"]
        rows.append(row)
    out["model_time_per_request"] = rows
    return out


def scenario_bound(scenario: Scenario, batches: Iterable[int] = (1, 2, 4, 16), draws: int = 200) -> dict[str, Any]:
    """`placement_bound` of a scenario's Mooncake trace (its first `load.num_requests` requests) over the
    replicas that run prefill in its first target, priced with that target's router profile if it has one."""
    spec = dict(scenario.workload)
    if spec.pop("kind", "synthetic") != "mooncake":
        raise ValueError("bound needs a scenario whose workload is a mooncake trace")
    trace = Mooncake(**spec)
    requests = [TraceRequest.from_record(r, trace) for r in trace.records(scenario.load.num_requests)]
    system = scenario.targets[0].system
    colocated = system.get("mode", "disaggregated") == "colocated"
    num_replicas = int(system.get("decode" if colocated else "prefill", {}).get("num_replicas", 1))
    profile_path = system.get("router", {}).get("profile_path")
    models = None
    if profile_path:
        profile = LatencyProfile.load(profile_path)
        models = Models(profile.for_role("decode" if colocated else "prefill"), profile.for_role("decode"))
    out = placement_bound(requests, trace.block_size, num_replicas, models, batches, draws, scenario.seed)
    return {"scenario": scenario.name, "trace": trace.path, "target": scenario.targets[0].name,
            "profile": profile_path, **out}
