"""The goodput runner's machine check: this machine's quick profile against the profile a scenario's SLOs
were set on, at reference shapes, with a verdict in summary.json and summary.md."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pdserve.latency_model import LatencyModel, LatencyProfile
import torch
from pdserve.loadtest.machine import SLOW_RATIO, check_machine, describe, profile_paths, replica_threads
from pdserve.loadtest.client import RequestResult
from pdserve.loadtest.evaluate import TargetResult
from pdserve.loadtest.metrics import summarize
from pdserve.loadtest.report import write_report
from pdserve.loadtest.runner import Run
from pdserve.loadtest.slo import SLO, IdleLatency
from pdserve.loadtest.sweep import SweepResult


@pytest.fixture(scope="module")
def measured() -> LatencyModel:
    from pdserve.bench.profile import run

    return run("tiny", quick=True)  # this machine, measured for real


def scaled(model: LatencyModel, factor: float) -> LatencyModel:
    p, d = model.prefill, model.decode
    return dataclasses.replace(
        model, prefill=dataclasses.replace(p, a=p.a * factor, b=p.b * factor, c=p.c * factor, d=p.d * factor),
        decode=dataclasses.replace(d, a=d.a * factor, b=d.b * factor, c=d.c * factor))


def saved(tmp_path, name: str, model: LatencyModel) -> str:
    path = tmp_path / f"{name}.json"
    LatencyProfile({"default": model}).save(path)
    return str(path)


def test_profile_paths_are_the_reference_then_each_router_profile_once():
    systems = [{"router": {"profile_path": "b.json"}}, {"mode": "colocated"}, {"router": {"profile_path": "a.json"}},
               {"router": {"profile_path": "b.json"}}, {"router": {}}]
    assert profile_paths("a.json", systems) == ["a.json", "b.json"]
    assert profile_paths(None, systems) == ["b.json", "a.json"]
    assert profile_paths(None, [{"mode": "colocated"}]) == []


def test_nothing_is_measured_without_a_profile():
    def fail(model: str) -> LatencyModel:
        raise AssertionError("measured with no profile to compare")

    assert check_machine("tiny", [], measure=fail) == []


def test_verdict_follows_the_ratio_of_measured_to_profiled_time(tmp_path, measured):
    same, fast_vm, slow_vm = (saved(tmp_path, n, scaled(measured, f)) for n, f in
                              (("same", 1.0), ("fast-vm", 1 / (2 * SLOW_RATIO)), ("slow-vm", 2 * SLOW_RATIO)))
    checks = check_machine("tiny", [same, fast_vm, slow_vm], measure=lambda m: measured)
    assert [c.profile_path for c in checks] == [same, fast_vm, slow_vm]
    assert [c.verdict for c in checks] == ["matches", "slower", "faster"]
    assert checks[0].ratios == pytest.approx({"prefill_1024": 1.0, "decode_b1_ctx1024": 1.0, "decode_b8_ctx1024": 1.0,
                                              "prefill_512_cached1024": 1.0})
    assert checks[1].slowest == pytest.approx(2 * SLOW_RATIO)


def test_the_real_measurement_reports_every_shape(tmp_path, measured):
    (check,) = check_machine("tiny", [saved(tmp_path, "p", measured)])  # measured again, for real
    assert [s[0] for s in check.shapes] == ["prefill_1024", "decode_b1_ctx1024", "decode_b8_ctx1024",
                                            "prefill_512_cached1024"]
    assert all(profiled > 0 and now > 0 for _, profiled, now in check.shapes)
    assert check.verdict in ("matches", "slower", "faster")  # timings are never asserted


def test_replica_threads_follow_each_role_s_cpus():
    assert replica_threads({"mode": "disaggregated", "prefill": {"num_cpus": 2}, "decode": {"num_cpus": 1}}) == {
        "prefill": 2, "decode": 1}
    assert replica_threads({"prefill": {"num_cpus": 0.5}}) == {"prefill": 1, "decode": 1}  # unstated: one CPU
    # colocated replicas are the decode pool, and they prefill: a prefill section is not theirs
    assert replica_threads({"mode": "colocated", "prefill": {"num_cpus": 4}, "decode": {"num_cpus": 3}}) == {
        "prefill": 3, "decode": 3}


def test_each_shape_is_timed_at_its_role_s_threads_and_threads_are_restored(tmp_path, measured):
    default, seen = torch.get_num_threads(), []

    def measure(model: str) -> LatencyModel:  # this machine, twice as slow per thread it gives up
        seen.append(torch.get_num_threads())
        return scaled(measured, 1.0 + (torch.get_num_threads() == 1))

    path = saved(tmp_path, "p", measured)
    (check,) = check_machine("tiny", [path], measure=measure, threads={"prefill": 1, "decode": 2})
    assert seen == [1, 2] and torch.get_num_threads() == default
    assert check.ratios == pytest.approx({"prefill_1024": 2.0, "decode_b1_ctx1024": 1.0, "decode_b8_ctx1024": 1.0,
                                          "prefill_512_cached1024": 2.0})
    shapes = check.to_dict()["shapes"]
    assert [s["threads"] for s in shapes] == [1, 2, 2, 1]
    assert "prefill_1024" in describe(check.to_dict()) and "at 1 thread," in describe(check.to_dict())
    (same,) = check_machine("tiny", [path], measure=measure, threads={"prefill": 2, "decode": 2})
    assert seen == [1, 2, 2]  # one measurement per thread count
    assert "threads" not in check_machine("tiny", [path], measure=measure)[0].to_dict()["shapes"][0]


def test_the_cached_prefix_shape_does_not_decide_the_verdict(tmp_path, measured):
    """A profile that under-prices a long cached prefix is a fit's fault, not a slower machine's."""
    p = measured.prefill
    cheap_cache = dataclasses.replace(measured, prefill=dataclasses.replace(p, d=p.d / 4))
    (check,) = check_machine("tiny", [saved(tmp_path, "p", cheap_cache)], measure=lambda m: measured)
    assert check.ratios["prefill_512_cached1024"] > 1.0 or p.d == 0
    assert check.slowest == pytest.approx(1.0) and check.verdict == "matches"


def one_target() -> TargetResult:
    t = TargetResult("a", IdleLatency(0.1, 0.01), SweepResult(), slo=SLO(1.0, 0.1))
    results = [RequestResult(i, 100, 4, 0.0, 0.0, "ok", 200, [0.1, 0.11, 0.12, 0.13], 0.13, 4) for i in range(4)]
    t.runs[1.0] = Run(results, 4.0, summarize(results, 4.0, 1.0), 0)
    t.sweep.points, t.sweep.goodput, t.sweep.bracket = {1.0: 1.0}, 1.0, (1.0, None)
    return t


def test_report_states_the_machine_verdict(tmp_path, measured):
    slow = check_machine("tiny", [saved(tmp_path, "slow-vm", scaled(measured, 0.25))], measure=lambda m: measured)
    out = tmp_path / "report"
    out.mkdir()
    write_report(out, [one_target()], SLO(1.0, 0.1), 1.0, 0.9,
                 {"scenario": "t", "machine": [c.to_dict() for c in slow]})
    summary = json.loads((out / "summary.json").read_text())
    assert summary["machine"][0]["verdict"] == "slower" and summary["machine"][0]["slowest_ratio"] == pytest.approx(4)
    md = (out / "summary.md").read_text()
    assert "- machine: 4.00× the time of" in md and "**slower than the profile" in md


def named(name: str, slowest_ratio: float, cpu: dict[str, float]) -> TargetResult:
    t = dataclasses.replace(one_target(), name=name)
    t.machine = [{"profile_path": "p.json", "verdict": "slower", "slowest_ratio": slowest_ratio, "shapes": []}]
    t.cpu = {1.0: cpu}
    return t


def test_report_states_the_machine_before_each_target_and_cpu_per_request(tmp_path):
    steady = [named("a", 1.5, {"decode": 2.0, "router": 0.4}), named("b", 1.6, {"decode": 1.2, "router": 0.4})]
    write_report(tmp_path, steady, SLO(1.0, 0.1), 1.0, 0.9, {"scenario": "t"})
    summary = json.loads((tmp_path / "summary.json").read_text())
    a, b = summary["targets"]
    assert a["machine"][0]["slowest_ratio"] == 1.5 and b["machine"][0]["slowest_ratio"] == 1.6
    # 4 requests completed at 1 req/s
    assert b["replica_cpu_s_per_request_at_cdf_rate"] == pytest.approx({"decode": 0.3, "router": 0.1, "all": 0.4})
    assert b["points"][0]["replica_cpu_s"] == {"decode": 1.2, "router": 0.4}
    md = (tmp_path / "summary.md").read_text()
    assert "- machine before each target (worst ratio to `p.json`): `a` 1.50×, `b` 1.60×; within 1.07×" in md
    assert "| `a` | 0.500 | 0.100 | 0.600 | 1.00× |" in md and "| `b` | 0.300 | 0.100 | 0.400 | 0.67× |" in md

    drifted = [named("a", 1.2, {"decode": 2.0}), named("b", 2.4, {"decode": 2.0})]
    write_report(tmp_path, drifted, SLO(1.0, 0.1), 1.0, 0.9, {"scenario": "t"})
    assert "**it moved 2.00× between targets" in (tmp_path / "summary.md").read_text()


def test_nothing_about_drift_or_cpu_when_not_measured(tmp_path):
    write_report(tmp_path, [one_target(), dataclasses.replace(one_target(), name="b")], SLO(1.0, 0.1), 1.0, 0.9,
                 {"scenario": "t"})
    md = (tmp_path / "summary.md").read_text()
    assert "machine before each target" not in md and "Replica CPU" not in md
    assert json.loads((tmp_path / "summary.json").read_text())["targets"][0]["replica_cpu_s_per_request_at_cdf_rate"] is None
