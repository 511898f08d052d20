"""The simulator and the live engine fed the same small trace: the same requests finish, with the same
output counts, in the same order (grouped by engine step), with the same preemptions. Counts and order
only, never timings. The live side is the in-process engine on the tiny model (no Ray); the simulated
side is one colocated replica of pdserve.sim with the same scheduler and pool settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import GenerationRequest, LLMEngine
from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel
from pdserve.models.tiny import ensure_tiny_checkpoint
from pdserve.placement.policy import PlacementConfig
from pdserve.sampling_params import SamplingParams
from pdserve.sim.cluster import Simulation
from pdserve.sim.config import ClusterSpec, EngineSpec, RouterSpec, SimRequest

# (prompt tokens, output tokens), all arriving at once in this order
TRACE = ((90, 30), (40, 60), (130, 12), (20, 45), (70, 25), (55, 50))
SETTINGS = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "num_blocks": 20, "block_size": 16}


def live(model_dir: Path) -> tuple[list[set[int]], list[set[int]], dict[int, int], int]:
    config = EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_threads=1,
                          cache=CacheConfig(num_blocks=SETTINGS["num_blocks"], block_size=SETTINGS["block_size"],
                                            enable_prefix_caching=False),
                          scheduler=SchedulerConfig(max_num_seqs=SETTINGS["max_num_seqs"],
                                                    max_num_batched_tokens=SETTINGS["max_num_batched_tokens"]))
    engine = LLMEngine(config)
    for i, (prompt, output) in enumerate(TRACE):
        tokens = tuple(1 + (7 * i + k) % 200 for k in range(prompt))  # distinct prompts: no shared prefix
        engine.add_request(GenerationRequest(str(i), tokens, SamplingParams(
            max_tokens=output, temperature=0.0, ignore_eos=True)))
    firsts, finishes, counts = [], [], {}
    while engine.has_unfinished():
        deltas = engine.step()
        first = {int(d.request_id) for d in deltas if d.num_output_tokens == len(d.token_ids)}
        done = {int(d.request_id) for d in deltas if d.finished}
        for d in deltas:
            counts[int(d.request_id)] = d.num_output_tokens
        firsts += [first] if first else []
        finishes += [done] if done else []
    preemptions = engine.num_preemptions
    engine.shutdown()
    return firsts, finishes, counts, preemptions


def grouped(times: dict[int, float]) -> list[set[int]]:
    out: dict[float, set[int]] = {}
    for index, t in times.items():
        out.setdefault(t, set()).add(index)
    return [out[t] for t in sorted(out)]


def simulated() -> tuple[list[set[int]], list[set[int]], dict[int, int], int]:
    model = LatencyModel(PrefillModel(0.01, 1e-4, 0.0), DecodeModel(0.005, 1e-4, 1e-7), 1024)
    engine = EngineSpec(max_num_seqs=SETTINGS["max_num_seqs"], max_num_batched_tokens=SETTINGS["max_num_batched_tokens"],
                        num_blocks=SETTINGS["num_blocks"], block_size=SETTINGS["block_size"],
                        enable_prefix_caching=False)
    router = RouterSpec(placement=PlacementConfig(policy="least_loaded", admission="queue"))
    spec = ClusterSpec(mode="colocated", num_decode=1, decode=engine, prefill=engine, router=router)
    requests = [SimRequest(i, 0.0, p, o) for i, (p, o) in enumerate(TRACE)]
    sim = Simulation(spec, LatencyProfile({"default": model}), requests)
    records = sim.run()
    assert [r.status for r in records] == ["ok"] * len(TRACE)
    counts = {r.request.index: r.request.output_tokens for r in records}
    return (grouped({r.request.index: r.first_token_s for r in records}),
            grouped({r.request.index: r.finish_s for r in records}), counts,
            sum(r.num_preemptions for r in records))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny-sim-vs-engine"))


def test_simulator_and_engine_agree_on_counts_and_order(model_dir):
    live_first, live_finish, live_counts, live_preempt = live(model_dir)
    sim_first, sim_finish, sim_counts, sim_preempt = simulated()
    assert live_counts == sim_counts == {i: o for i, (_, o) in enumerate(TRACE)}
    assert live_first == sim_first
    assert live_finish == sim_finish
    assert live_preempt == sim_preempt
    assert live_preempt > 0  # the pool is small enough that the trace exercises preemption
