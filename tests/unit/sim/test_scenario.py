"""Scenario targets as cluster shapes, and the load tests' own workloads and arrivals reproduced exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pdserve.loadtest.runner import LoadConfig, run_point  # noqa: F401  (the runner these requests mirror)
from pdserve.loadtest.scenario import Scenario
from pdserve.loadtest.workloads import Mooncake, TokenSource, workload
from pdserve.sim.scenario import cluster_spec, load_profile
from pdserve.sim.workload import requests_for, trace_hashes

REPO = Path(__file__).resolve().parents[3]
SCENARIOS = REPO / "loadtest/scenarios"
PROFILE = load_profile(SCENARIOS / "profiles/random-llama-h512-l4.json")


def test_targets_map_to_cluster_shapes():
    scenario = Scenario.from_yaml(SCENARIOS / "disagg-vs-colocated.yaml")
    specs = {t.name: cluster_spec(t.system, PROFILE) for t in scenario.targets}
    disagg, no_chunk, chunked = specs["disaggregated"], specs["colocated-no-chunking"], specs["colocated-chunked"]
    assert (disagg.mode, disagg.num_prefill, disagg.num_decode) == ("disaggregated", 1, 1)
    assert disagg.prefill.max_num_batched_tokens == 4096 and disagg.decode.max_num_batched_tokens == 2048
    assert disagg.decode.num_blocks == (256 << 20) // (4096 * 16)  # the worker's KV budget over 4 KiB/token
    assert no_chunk.mode == "colocated" and not no_chunk.decode.enable_chunked_prefill
    assert chunked.decode.enable_chunked_prefill and chunked.decode.max_num_batched_tokens == 512
    # no router profile: slo_aware (the default) falls back to least_loaded, as the live placer does
    assert not disagg.router.has_profile

    policies = Scenario.from_yaml(SCENARIOS / "router-policies.yaml")
    spec = cluster_spec(policies.targets[2].system, PROFILE)
    assert (spec.num_decode, spec.router.placement.policy, spec.router.has_profile) == (3, "slo_aware", True)
    assert (spec.router.ttft_slo_s, spec.router.tpot_slo_s) == (2.5, 0.025)


def test_synthetic_lengths_match_the_live_workload():
    scenario = Scenario.from_yaml(SCENARIOS / "router-policies.yaml")
    work, load = workload(scenario.workload), scenario.load.config(scenario.seed)
    simulated = requests_for(work, load, 0.5)
    from pdserve.loadtest.runner import run_seed

    live = work.requests(TokenSource((1, 2, 3), lambda text: []), load.num_requests, run_seed(load.seed, 0.5))
    assert [(r.prompt_tokens, r.output_tokens) for r in simulated] == [(s.prompt_len, s.output_len) for s in live]
    gaps = np.diff([r.arrival_s for r in simulated])
    assert simulated[0].arrival_s == 0.0 and np.all(gaps >= 0) and 0.25 < 1 / gaps.mean() < 1.0


def test_trace_replay_keeps_the_lengths_the_times_and_the_shared_prefixes(monkeypatch):
    monkeypatch.chdir(REPO)
    scenario = Scenario.from_yaml(SCENARIOS / "prefix-routing.yaml")
    work, load = workload(scenario.workload), scenario.load.config(scenario.seed)
    assert isinstance(work, Mooncake)
    records = work.records(load.num_requests)
    simulated = requests_for(work, load, 2.0)
    assert [r.prompt_tokens for r in simulated] == [work.lengths(x)[0] for x in records]
    assert abs((len(simulated) - 1) / simulated[-1].arrival_s - 2.0) < 1e-9  # time-scaled to the rate
    # requests over one system prompt share its 1024 tokens: 64 engine blocks of 16
    same = [r for r, x in zip(simulated, records) if x["hash_ids"][0] == records[0]["hash_ids"][0]]
    assert len(same) > 1 and same[0].block_hashes[:64] == same[1].block_hashes[:64]


def test_trace_hashes_expand_trace_blocks_into_engine_blocks():
    assert trace_hashes([7, 9], 100, 64, 16) == tuple(7 * 65536 + j for j in range(4)) + (9 * 65536, 9 * 65536 + 1)
