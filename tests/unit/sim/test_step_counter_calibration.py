"""The engines' step counters in a report (pdserve.loadtest.engine_steps) calibrate the profile's speed to the
replicas' own steps and the serving cost per step to the gaps between them (pdserve.loadtest.validation_model):
a report built from known steps is calibrated back to them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from pdserve.loadtest.validate import load_scenario
from pdserve.loadtest.validation_model import Model
from pdserve.sim.calibrate import Calibration, cached_prefill_scale, scales_from_machine

REPO = Path(__file__).resolve().parents[3]
K_DECODE, K_PREFILL = 1.3, 0.85


@pytest.fixture(scope="module")
def setup(prefix_routing_run):
    return prefix_routing_run


def check_scales(target: dict, profile) -> tuple[tuple[float, float, float], float | None]:
    check = target["machine"][0]
    scales = scales_from_machine(check, profile)
    return scales, cached_prefill_scale(check, profile, scales[0])


def countered(target: dict, model: Model, profile, gap_s: float, gap_wait_s: float,
              step_wait_share: float = 0.0) -> tuple[dict, Calibration]:
    """The target as if its engines stepped K_DECODE and K_PREFILL times the machine check's time and each gap
    between steps took `gap_s`, `gap_wait_s` of it waiting for a core: the counters its lowest point would give."""
    target = copy.deepcopy(target)
    (p, f, r), cached = check_scales(target, profile)
    truth = Calibration(p * K_PREFILL, f * K_DECODE, r * K_DECODE,
                        prefill_cached_scale=None if cached is None else cached * K_PREFILL)
    low = min(target["points"], key=lambda q: q["rate"])
    _, _, steps = model.simulate(model.spec(target), truth, low["rate"])
    low["engine_steps"] = {
        role: {**s, "replicas": 3, "step_wait_s": step_wait_share * s["step_s"], "num_gaps": s["num_steps"] - 1,
               "gap_s": gap_s * (s["num_steps"] - 1), "gap_wait_s": gap_wait_s * (s["num_steps"] - 1)}
        for role, s in steps.items() if s["num_steps"]}
    return target, truth


@pytest.mark.parametrize("target_index", [0, 1])
def test_the_steps_speed_and_the_gaps_work_are_calibrated_back(setup, target_index):
    report, profile, model = setup
    target, truth = countered(report["targets"][target_index], model, profile, gap_s=0.0009, gap_wait_s=0.0004)
    scales, cached = check_scales(target, profile)
    cal = model.calibrate(model.spec(target), target, scales, "machine check", cached)
    assert cal.serving_step_s == pytest.approx(0.0005)  # the gap's own work; its wait is the host's sharing
    assert cal.decode_fixed_scale == pytest.approx(truth.decode_fixed_scale, rel=0.03)
    assert cal.decode_row_scale == pytest.approx(truth.decode_row_scale, rel=0.03)
    assert cal.prefill_scale == pytest.approx(truth.prefill_scale, rel=0.03)
    assert cal.relay_token_s == 0.0  # the counters replace the batch probe's and idle probe's serving costs
    assert cal.wake_wait_s == 0.0  # the steps never waited for a core: the gaps' waits say nothing of a busy host


@pytest.mark.parametrize("wake_wait", ["measured", "off"])
def test_the_wake_up_wait_is_the_gaps_wait_over_the_steps_share_of_waiting(setup, wake_wait):
    report, profile, _ = setup
    model = Model(load_scenario(str(REPO / "loadtest/scenarios/prefix-routing-fixed.yaml")), report, profile,
                  poll_phases=1, wake_wait=wake_wait)
    target, _ = countered(report["targets"][1], model, profile, gap_s=0.0009, gap_wait_s=0.0004, step_wait_share=0.2)
    scales, cached = check_scales(target, profile)
    cal = model.calibrate(model.spec(target), target, scales, "machine check", cached)
    assert cal.wake_wait_s == (pytest.approx(0.002) if wake_wait == "measured" else 0.0)
    assert cal.serving_step_s == pytest.approx(0.0005)
    with pytest.raises(ValueError, match="wake wait"):
        Model(load_scenario(str(REPO / "loadtest/scenarios/prefix-routing-fixed.yaml")), report, profile,
              wake_wait="sometimes")


def test_the_batch_probe_calibrates_reports_without_counters_and_on_request(setup):
    report, profile, model = setup
    scenario = load_scenario(str(REPO / "loadtest/scenarios/prefix-routing-fixed.yaml"))
    probe = Model(scenario, report, profile, poll_phases=1, serving_cost="step")  # `--serving-cost step`
    plain = report["targets"][0]
    assert "engine_steps" not in min(plain["points"], key=lambda q: q["rate"])  # committed before the counters
    scales, cached = check_scales(plain, profile)
    spec = model.spec(plain)
    cal = model.calibrate(spec, plain, scales, "machine check", cached)
    assert cal == probe.calibrate(spec, plain, scales, "machine check", cached)
    assert (cal.decode_fixed_scale, cal.prefill_scale) == (scales[1], scales[0])
    target, _ = countered(plain, model, profile, gap_s=0.0009, gap_wait_s=0.0004)
    assert probe.calibrate(spec, target, scales, "machine check", cached) == cal  # the counters left unread


def test_the_committed_counters_give_a_sub_millisecond_gap_and_a_wake_up_wait_of_a_few(setup):
    """prefix-routing-fixed's runs with the counters (step-counters/): what the calibration found in them, and
    the simulator's steps at the lowest rate beside the live ones."""
    _, profile, _ = setup
    scenario = load_scenario(str(REPO / "loadtest/scenarios/prefix-routing-fixed.yaml"))
    for run in (1, 2, 3):
        path = REPO / f"loadtest/results/prefix-routing-fixed/step-counters/run-{run}/summary.json"
        report = json.loads(path.read_text())
        model = Model(scenario, report, profile, poll_phases=1)
        for target in report["targets"]:
            low = min(target["points"], key=lambda q: q["rate"])
            live = low["engine_steps"]["decode"]
            assert live["replicas"] == 3 and live["step_cpu_s"] + live["step_wait_s"] <= live["step_s"] * 1.01
            scales, cached = check_scales(target, profile)
            spec = model.spec(target)
            cal = model.calibrate(spec, target, scales, "machine check", cached)
            assert 0.0002 < cal.serving_step_s < 0.001 and 0.001 < cal.wake_wait_s < 0.004
            _, _, steps = model.simulate(spec, cal, low["rate"])
            assert steps["decode"]["num_steps"] == pytest.approx(live["num_steps"], rel=0.1)
            assert steps["decode"]["step_cpu_s"] == pytest.approx(live["step_cpu_s"], rel=0.2)
