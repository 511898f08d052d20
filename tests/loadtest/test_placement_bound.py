"""`pdserve-loadtest bound`: the prefix hits any placement can reach on a trace (one cache that has seen
everything) against a cache-blind placement, and what they are worth in model time per request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pdserve.latency_model import DecodeModel, LatencyModel, PrefillModel
from pdserve.loadtest.placement_bound import (
    Models, TraceRequest, cache_blind_hits, ceiling_hits, hit_tokens, placement_bound,
)

ROOT = Path(__file__).resolve().parents[2]
BS = 4


def req(*ids: int, output: int = 8) -> TraceRequest:
    return TraceRequest(tuple(ids), len(ids) * BS, output)


# chat A's first turn, chat B's first turn over the same system prompt (1, 2), then A's second turn
CHATS = [req(1, 2, 10), req(1, 2, 20), req(1, 2, 10, 11, 12)]


def test_the_ceiling_hits_the_longest_prefix_seen_before_whatever_the_chat():
    assert ceiling_hits(CHATS, BS) == [0, 2 * BS, 3 * BS]


def test_a_block_hits_only_after_the_same_prefix():
    # block 2 was seen, but after block 1: a prompt that starts with it shares no prefix
    assert ceiling_hits([req(1, 2, 3), req(2, 3, 4)], BS) == [0, 0]


def test_the_last_token_is_always_computed():
    # the whole prompt seen before: every block but the one holding the last token hits
    assert ceiling_hits([req(1, 2, 3), req(1, 2, 3)], BS) == [0, 2 * BS]
    # a prompt ending inside a block: its whole leading blocks hit
    partial = TraceRequest((1, 2, 3), 3 * BS - 1, 8)
    assert hit_tokens(partial, {(1,), (1, 2), (1, 2, 3)}, BS) == 2 * BS


def test_one_replica_is_the_ceiling_and_more_replicas_hit_less():
    ceiling = ceiling_hits(CHATS, BS)
    assert cache_blind_hits(CHATS, BS, 1, draws=5).tolist() == [ceiling] * 5
    for n in (2, 3, 8):
        blind = cache_blind_hits(CHATS, BS, n, draws=400)
        assert (blind <= ceiling).all()
        assert blind.sum(axis=1).mean() < sum(ceiling)
    # B's first turn finds the system prompt (2 blocks) only on A's replica: 1 draw in 2
    assert cache_blind_hits(CHATS, BS, 2, draws=2000)[:, 1].mean() == pytest.approx(BS, rel=0.1)


def model(decode_fixed_s: float) -> LatencyModel:
    return LatencyModel(PrefillModel(0.0, 1e-3, 0.0), DecodeModel(decode_fixed_s, 0.0, 0.0), kv_bytes_per_token=8)


def test_model_time_prices_only_the_uncached_prefill_and_shares_decode_steps_by_batch():
    out = placement_bound(CHATS, BS, 3, Models(model(0.0), model(0.0)), batches=(1,), draws=50)
    row = out["model_time_per_request"][0]
    computed = out["computed_prompt_tokens_per_request"]
    assert row["ceiling"]["prefill_s"] == pytest.approx(1e-3 * computed["ceiling"])
    assert row["cache_blind"]["prefill_s"] == pytest.approx(1e-3 * computed["cache_blind"])
    # free decode steps and a linear prefill: the capacity ratio is the prefill work's
    assert row["capacity_ratio"] == pytest.approx(computed["cache_blind"] / computed["ceiling"])

    slow = Models(model(0.0), model(0.01))
    rows = placement_bound(CHATS, BS, 3, slow, batches=(1, 4), draws=50)["model_time_per_request"]
    assert rows[0]["ceiling"]["decode_s"] == pytest.approx(8 * 0.01)
    assert rows[1]["ceiling"]["decode_s"] == pytest.approx(8 * 0.01 / 4)
    # decode steps placement cannot remove dilute what it saves, less so as they batch
    assert 1.0 < rows[0]["capacity_ratio"] < rows[1]["capacity_ratio"] < row["capacity_ratio"]


def test_an_empty_trace_is_refused():
    with pytest.raises(ValueError):
        placement_bound([], BS, 3)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cli = Path(sys.executable).with_name("pdserve-loadtest")
    return subprocess.run([str(cli), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_bound_of_the_committed_prefix_routing_scenario_as_users_run_it():
    done = run_cli("bound", "loadtest/scenarios/prefix-routing.yaml")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["requests"] == 84 and out["num_replicas"] == 3 and out["block_size"] == 64
    hits = out["prefix_hit_rate"]
    assert 0 < hits["cache_blind"] < hits["ceiling"] < 1
    rows = out["model_time_per_request"]
    assert [r["decode_batch"] for r in rows] == [1, 2, 4, 16]
    assert all(r["capacity_ratio"] > 1 for r in rows)


def test_bound_refuses_a_scenario_without_a_trace(tmp_path):
    done = run_cli("bound", "loadtest/scenarios/smoke.yaml")
    assert done.returncode == 2
    assert "mooncake" in done.stderr


def test_the_bound_sees_prompts_as_the_load_cuts_them(tmp_path):
    from pdserve.loadtest.placement_bound import scenario_bound
    from pdserve.loadtest.scenario import Scenario

    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 0, "input_length": 12, "output_length": 8, "hash_ids": [1, 2, 3]},
            {"timestamp": 1, "input_length": 16, "output_length": 8, "hash_ids": [1, 2, 3, 4]}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def bound(**limits):
        scenario = Scenario(name="b", workload={"kind": "mooncake", "path": str(trace), "block_size": 4, **limits},
                            load={"num_requests": 2}, targets=[{"name": "t", "system": {"mode": "colocated"}}])
        return scenario_bound(scenario, draws=5)

    assert bound()["prefix_hit_rate"]["ceiling"] == pytest.approx(12 / 28)
    # cut at 8 tokens, the second request's two blocks hold its last token: one block hits
    assert bound(max_prompt_len=8)["prefix_hit_rate"]["ceiling"] == pytest.approx(4 / 16)


@pytest.mark.parametrize("args", [("--batches", "0"), ("--batches", "2,x"), ("--draws", "0")])
def test_bound_refuses_bad_options_with_a_message(args):
    done = run_cli("bound", "loadtest/scenarios/prefix-routing.yaml", *args)
    assert done.returncode == 2 and done.stderr.startswith("pdserve-loadtest: ")
    assert "Traceback" not in done.stderr
