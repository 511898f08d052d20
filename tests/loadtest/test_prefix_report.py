"""The load test's prefix-cache figures: hit rate from usage.prompt_tokens_details.cached_tokens, and the
report's TTFT p50 ratio and hit rate per target (fabricated results; the client's parsing of a real
server's usage is exercised in tests/integration/test_prefix_routing_serve.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdserve.loadtest.client import RequestResult, cached_tokens
from pdserve.loadtest.evaluate import TargetResult
from pdserve.loadtest.metrics import prefix_hit_rate, summarize
from pdserve.loadtest.prefix_trace import chat_trace, write_trace
from pdserve.loadtest.report import write_report
from pdserve.loadtest.runner import Run
from pdserve.loadtest.scenario import Scenario
from pdserve.loadtest.slo import SLO, IdleLatency
from pdserve.loadtest.sweep import SweepResult


def result(i: int, prompt: int, cached: int, ttft: float, status: str = "ok") -> RequestResult:
    return RequestResult(i, prompt, 4, 0.0, 0.0, status, 200, [ttft, ttft + 0.01, ttft + 0.02, ttft + 0.03],
                         ttft + 0.03, 4, cached_tokens=cached)


def test_hit_rate_counts_completed_requests_only():
    runs = [result(0, 100, 80, 0.1), result(1, 300, 0, 0.2), result(2, 1000, 1000, 0.1, status="error")]
    assert prefix_hit_rate(runs) == 80 / 400
    assert prefix_hit_rate([]) is None
    assert summarize(runs, 1.0, 1.0).prefix_hit_rate == 80 / 400


def target(name: str, cached: int, ttft: float) -> TargetResult:
    t = TargetResult(name, IdleLatency(0.1, 0.01), SweepResult(), slo=SLO(1.0, 0.1))
    for rate in (1.0, 2.0):
        results = [result(i, 100, cached, ttft) for i in range(4)]
        t.runs[rate] = Run(results, 4.0, summarize(results, 4.0, rate), 0)
    t.sweep.points, t.sweep.goodput, t.sweep.bracket = {1.0: 1.0, 2.0: 1.0}, 2.0, (2.0, None)
    return t


def test_report_gives_ttft_p50_ratio_and_hit_rate_per_target(tmp_path):
    targets = [target("least_loaded", 10, 0.4), target("kv_aware", 90, 0.1), target("round_robin", 0, 0.8)]
    write_report(tmp_path, targets, SLO(1.0, 0.1), 1.0, 0.9, {"scenario": "t"})
    summary = json.loads((tmp_path / "summary.json").read_text())
    by_name = {t["name"]: t for t in summary["targets"]}
    assert [t["name"] for t in summary["targets"]] == ["least_loaded", "kv_aware", "round_robin"]
    assert by_name["kv_aware"]["prefix_hit_rate"] == 0.9 and by_name["round_robin"]["prefix_hit_rate"] == 0.0
    assert by_name["kv_aware"]["prefix_hit_rate_at_cdf_rate"] == 0.9
    assert by_name["kv_aware"]["ttft_p50_vs_baseline"] == 0.25
    assert by_name["round_robin"]["ttft_p50_vs_baseline"] == 2.0
    md = (tmp_path / "summary.md").read_text()
    assert "## Prefix cache" in md and "| `kv_aware` | 90% | 90% | 100 | 0.25× | 0.03 |" in md
    # 4 requests each 30 ms from first token to end, in 4 s
    assert by_name["kv_aware"]["points"][0]["summary"]["decoding_concurrency"] == pytest.approx(0.03)


def test_report_gives_the_placement_ceiling_of_a_trace(tmp_path):
    from pdserve.latency_model import DecodeModel, LatencyModel, PrefillModel
    from pdserve.loadtest.placement_bound import Models, TraceRequest, placement_bound

    chats = [TraceRequest((1, 2, 10), 12, 8), TraceRequest((1, 2, 20), 12, 8), TraceRequest((1, 2, 10, 11), 16, 8)]
    model = LatencyModel(PrefillModel(0.0, 1e-3, 0.0), DecodeModel(0.01, 0.0, 0.0), kv_bytes_per_token=8)
    bound = placement_bound(chats, 4, 3, Models(model, model), batches=(1, 16), draws=20)
    targets = [target("least_loaded", 10, 0.4), target("kv_aware", 90, 0.1)]
    write_report(tmp_path, targets, SLO(1.0, 0.1), 1.0, 0.9, {"scenario": "t", "placement_bound": bound})
    assert json.loads((tmp_path / "summary.json").read_text())["placement_bound"] == json.loads(json.dumps(bound))
    md = (tmp_path / "summary.md").read_text()
    assert "## Placement ceiling of the trace" in md
    assert f"caches {bound['prefix_hit_rate']['ceiling']:.0%} of prompt tokens" in md
    ratios = " | ".join(f"{r['capacity_ratio']:.2f}×" for r in bound["model_time_per_request"])
    assert "| decode batch | 1 | 16 |" in md and f"| capacity ratio | {ratios} |" in md
    # no bound (a synthetic workload): no section
    write_report(tmp_path, targets, SLO(1.0, 0.1), 1.0, 0.9, {"scenario": "t", "placement_bound": None})
    assert "Placement ceiling" not in (tmp_path / "summary.md").read_text()


def test_the_prefix_routing_scenario_validates():
    from importlib.resources import files

    from pdserve.services.app import SystemConfig

    scenario = Scenario.from_yaml(files("pdserve.loadtest") / "scenarios" / "prefix-routing.yaml")
    assert [t.name for t in scenario.targets] == ["least_loaded", "kv_aware", "round_robin"]
    for t in scenario.targets:
        SystemConfig.model_validate({"model": "tiny", **t.system})


def test_cached_tokens_read_from_usage():
    assert cached_tokens({"completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 64}}) == 64
    assert cached_tokens({"completion_tokens": 3}) == 0
    assert cached_tokens({"completion_tokens": 3, "prompt_tokens_details": None}) == 0
    for bad in ({"cached_tokens": -1}, {"cached_tokens": "64"}, {"cached_tokens": True}):
        with pytest.raises(ValueError):
            cached_tokens({"completion_tokens": 3, "prompt_tokens_details": bad})
    with pytest.raises(TypeError):
        cached_tokens({"completion_tokens": 3, "prompt_tokens_details": [64]})


def test_the_committed_trace_is_the_generator_output_and_turns_resend_their_history(tmp_path):
    records = chat_trace()
    write_trace(records, tmp_path / "trace.jsonl", block_size=64)
    # the path the scenario names, relative to the repository root
    committed = Path(__file__).resolve().parents[2] / "loadtest/scenarios/traces/prefix-routing.jsonl"
    assert (tmp_path / "trace.jsonl").read_text() == committed.read_text()
    rows = [json.loads(line) for line in committed.read_text().splitlines()]
    assert [r["timestamp"] for r in rows] == sorted(r["timestamp"] for r in rows)
    last: dict[int, list[int]] = {}
    for r in sorted(rows, key=lambda r: (r["chat"], r["turn"])):
        assert r["input_length"] == 64 * len(r["hash_ids"])
        if r["turn"]:
            previous = last[r["chat"]]
            assert r["hash_ids"][:len(previous)] == previous and len(r["hash_ids"]) > len(previous)
        last[r["chat"]] = r["hash_ids"]
    systems = {tuple(r["hash_ids"][:16]) for r in rows}
    assert len(systems) == 3  # a few long system prompts, each shared by several chats
