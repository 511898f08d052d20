"""A serving probe in a report (pdserve.loadtest.serving_probe) calibrates the serving path's TTFT, fixed and
per prompt token (pdserve.loadtest.validation_model); the prefill's speed stays the machine check's."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from pdserve.loadtest.validation_model import Model
from pdserve.sim.calibrate import Calibration, cached_prefill_scale, scales_from_machine
from pdserve.sim.config import SimRequest
from pdserve.sim.scenario import cached_ttft, idle_latency

REPO = Path(__file__).resolve().parents[3]
REPORT = REPO / "loadtest/results/prefix-routing-fixed/run-1/summary.json"
FIXED_S, PER_TOKEN_S = 0.008, 5e-6


@pytest.fixture(scope="module")
def setup(prefix_routing_run):
    return prefix_routing_run


def probed(report: dict, model: Model, profile, target_index: int) -> tuple[dict, Calibration, float]:
    """The target as if the live system had the serving path FIXED_S + PER_TOKEN_S a prompt token and
    prefilled as its machine check says: the serving probe it would give."""
    target = copy.deepcopy(report["targets"][target_index])
    check = target["machine"][0]
    scales = scales_from_machine(check, profile)
    truth = Calibration(*scales, prefill_cached_scale=cached_prefill_scale(check, profile, scales[0]))
    spec, live = model.spec(target), truth.profile(profile)
    short = idle_latency(spec, live, [SimRequest(0, 0.0, 16, 2)]).ttft_s + FIXED_S
    cold = cached_ttft(spec, live, 1024, 0) + FIXED_S + PER_TOKEN_S * 1024
    hit = cached_ttft(spec, live, 1024, 1008) + FIXED_S + PER_TOKEN_S * 1024
    target["serving_probe"] = {
        "requests": 3, "prompt_len": 16, "output_len": 2, "ttft_ms": short * 1e3, "each_ttft_ms": [short * 1e3] * 3,
        "cached_len": 1024, "cached_sends": [{"ttft_ms": cold * 1e3, "cached_tokens": 0}]
        + [{"ttft_ms": hit * 1e3, "cached_tokens": 1008}] * 3}
    return target, truth


def test_the_committed_runs_serving_path_is_a_few_milliseconds_and_microseconds_per_token(setup):
    """prefix-routing-fixed's runs since the probe: what the calibration found in them."""
    report, profile, model = setup
    for target in report["targets"]:
        check = target["machine"][0]
        scales = scales_from_machine(check, profile)
        cal = model.calibrate(model.spec(target), target, scales, "machine check",
                              cached_prefill_scale(check, profile, scales[0]))
        assert 0 < cal.serving_ttft_s < 0.02 and cal.serving_ttft_token_s < 1e-5  # under 15 ms at 1,520 tokens


@pytest.mark.parametrize("target_index", [0, 1])
def test_the_serving_path_is_calibrated_back(setup, target_index):
    report, profile, model = setup
    target, truth = probed(report, model, profile, target_index)
    check = target["machine"][0]
    scales = scales_from_machine(check, profile)
    spec = model.spec(target)
    cal = model.calibrate(spec, target, scales, "machine check", cached_prefill_scale(check, profile, scales[0]))
    assert cal.serving_ttft_s == pytest.approx(FIXED_S, rel=0.05)
    assert cal.serving_ttft_token_s == pytest.approx(PER_TOKEN_S, rel=0.1)
    assert (cal.prefill_scale, cal.prefill_cached_scale) == (truth.prefill_scale, truth.prefill_cached_scale)


def test_without_a_serving_probe_the_idle_gap_is_the_serving_cost_and_the_check_times_the_prefill(setup):
    _, profile, model = setup
    report = json.loads((REPORT.parents[1] / "before-serving-probe/run-1/summary.json").read_text())
    target = report["targets"][0]
    assert "serving_probe" not in target  # a committed run from before the probe
    check = target["machine"][0]
    scales = scales_from_machine(check, profile)
    cal = model.calibrate(model.spec(target), target, scales, "machine check",
                          cached_prefill_scale(check, profile, scales[0]))
    assert cal.prefill_scale == pytest.approx(scales[0]) and cal.serving_ttft_token_s == 0.0
