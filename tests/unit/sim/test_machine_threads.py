"""`pdserve-loadtest validate --replica-threads` (pdserve.loadtest.machine_threads): a report's machine check
scaled shape by shape, the factors as measured at two thread counts, and the calibration they move."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pdserve.latency_model import DecodeModel, LatencyModel, PrefillModel
from pdserve.loadtest.machine import SHAPES
from pdserve.loadtest.machine_threads import thread_factors, with_thread_factors
from pdserve.loadtest.scenario import Scenario
from pdserve.loadtest.validate import validate

REPO = Path(__file__).resolve().parents[3]
RUN = REPO / "loadtest/results/disagg-vs-colocated/summary.json"  # its checks ran at the default threads
FACTORS = {"prefill_1024": 1.8, "decode_b1_ctx1024": 1.1, "decode_b8_ctx1024": 1.3}


def test_each_shape_is_scaled_by_its_own_factor_and_the_report_is_left_alone():
    check = json.loads(RUN.read_text())["machine"][0]
    scaled = with_thread_factors(check, FACTORS)
    for before, after in zip(check["shapes"], scaled["shapes"]):
        assert after["measured_ms"] == pytest.approx(before["measured_ms"] * FACTORS[before["shape"]])
        assert after["ratio"] == pytest.approx(after["measured_ms"] / after["profile_ms"])
    assert check == json.loads(RUN.read_text())["machine"][0]
    with pytest.raises(ValueError, match="decode_b8_ctx1024"):
        with_thread_factors(check, {k: v for k, v in FACTORS.items() if k != "decode_b8_ctx1024"})


def test_a_shape_timed_at_the_replicas_threads_is_not_scaled_again():
    check = json.loads(RUN.read_text())["machine"][0]
    check["shapes"][0]["threads"] = 1  # as the runner records it since it times the replicas' threads
    scaled = with_thread_factors(check, {k: v for k, v in FACTORS.items() if k != "prefill_1024"})
    assert scaled["shapes"][0] == check["shapes"][0]
    assert scaled["shapes"][1]["measured_ms"] == pytest.approx(check["shapes"][1]["measured_ms"] * 1.1)


def test_factors_are_the_shapes_time_at_n_threads_over_the_default_and_threads_are_restored():
    default = torch.get_num_threads()
    seen = []

    def measure(model: str) -> LatencyModel:  # a machine whose every step takes 2x as long at one thread
        seen.append(torch.get_num_threads())
        slow = 2.0 if torch.get_num_threads() == 1 and default > 1 else 1.0
        return LatencyModel(PrefillModel(0.01 * slow, 1e-4 * slow, 1e-8 * slow),
                            DecodeModel(0.004 * slow, 1e-4 * slow, 1e-7 * slow), 4096)

    factors = thread_factors("any", 1, rounds=2, measure=measure)
    assert set(factors) == {name for name, _, _ in SHAPES}
    assert all(f == pytest.approx(2.0 if default > 1 else 1.0) for f in factors.values())
    assert seen == ([1, default] * 2 if default > 1 else [1, 1]) and torch.get_num_threads() == default


def test_factors_move_the_prefill_scale_by_their_prefill_factor():
    scenario = Scenario.from_yaml(REPO / "loadtest/scenarios/disagg-vs-colocated.yaml")
    plain = validate(scenario, RUN)
    ones = validate(scenario, RUN, thread_factors=dict.fromkeys(FACTORS, 1.0))
    scaled = validate(scenario, RUN, thread_factors=FACTORS)
    assert ones["figures"] == plain["figures"] and scaled["replica_thread_factors"] == FACTORS
    for name, cal in plain["calibration"].items():
        assert scaled["calibration"][name]["prefill_scale"] == pytest.approx(cal["prefill_scale"] * 1.8)


def test_the_what_if_scales_only_targets_whose_replicas_run_that_many_threads():
    """disagg-vs-colocated's report: the disaggregated replicas ran one thread, its colocated replica two."""
    scenario = Scenario.from_yaml(REPO / "loadtest/scenarios/disagg-vs-colocated.yaml")
    plain = validate(scenario, RUN)
    one = validate(scenario, RUN, thread_factors=FACTORS, replica_threads_n=1)
    assert one["calibration"]["disaggregated"]["prefill_scale"] == pytest.approx(
        plain["calibration"]["disaggregated"]["prefill_scale"] * 1.8)
    for name in ("colocated-no-chunking", "colocated-chunked"):
        assert one["calibration"][name]["prefill_scale"] == pytest.approx(plain["calibration"][name]["prefill_scale"])
