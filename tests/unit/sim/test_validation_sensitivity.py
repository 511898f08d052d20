"""`pdserve-loadtest validate --speed-sensitivity`: each figure's elasticity to the replicas' speed, its margin
within the ±20% target, and the machine checks' spread as the host's speed varies between measurements."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from pdserve.loadtest.cli import main as loadtest_main
from pdserve.loadtest.validation_sensitivity import RunSpeeds, margin, sensitivity, slower, spread
from pdserve.sim.calibrate import Calibration

REPO = Path(__file__).resolve().parents[3]


def test_margin_is_the_speed_error_that_moves_a_figure_by_the_target():
    assert margin(1.0) == pytest.approx(0.2)
    assert margin(2.0) == pytest.approx(math.sqrt(1.2) - 1)
    assert margin(-2.0) == margin(2.0)  # a figure falling as the replicas slow needs the same margin
    assert margin(0.0) == math.inf
    assert (1 + margin(3.5)) ** 3.5 == pytest.approx(1.2)


def test_slower_stretches_every_replica_term_and_nothing_else():
    cal = Calibration(prefill_scale=1.2, decode_fixed_scale=0.7, decode_row_scale=0.5, serving_step_s=0.001,
                      wake_wait_s=0.002, prefill_cached_scale=3.0)
    out = slower(cal, 1.1)
    assert (out.prefill_scale, out.decode_fixed_scale, out.decode_row_scale, out.prefill_cached_scale) == \
        pytest.approx((1.32, 0.77, 0.55, 3.3))
    assert (out.serving_step_s, out.wake_wait_s) == (cal.serving_step_s, cal.wake_wait_s)
    assert slower(Calibration(), 1.1).prefill_cached_scale is None


def test_sensitivity_sets_each_figures_margin_against_the_machine_checks_spread_within_a_run():
    runs = [RunSpeeds(elasticity={"a/1/tpot_p50_ms": e1, "a/4/tpot_p50_ms": e4},
                      shapes=[{"prefill_1024": p, "decode_b1_ctx1024": d}, {"prefill_1024": p * 1.1,
                                                                        "decode_b1_ctx1024": d * k}])
            for e1, e4, p, d, k in ((1.0, 3.0, 200.0, 3.0, 1.2), (1.2, 4.0, 300.0, 2.0, 1.1),
                                    (0.8, 3.5, 400.0, 3.3, 1.3))]
    out = sensitivity(runs)
    assert out["machine_checks"] == 6
    # within each run: prefill 10% apart, decode 20%, 10%, 30%; another run's speed does not count
    assert out["machine_check_spread"] == {"decode_b1_ctx1024": pytest.approx(0.1 / 1.1),
                                           "prefill_1024": pytest.approx(0.05 / 1.05)}
    assert out["host_speed_spread"] == pytest.approx((0.1 / 1.1 + 0.05 / 1.05) / 2)
    assert sensitivity([RunSpeeds(elasticity={"a/1/tpot_p50_ms": 1.0}, shapes=[{"prefill_1024": 1.0}])])[
        "host_speed_spread"] is None  # one check a run: no spread to read

    low, high = out["figures"]["a/1/tpot_p50_ms"], out["figures"]["a/4/tpot_p50_ms"]
    assert low["elasticity"] == pytest.approx(1.0) and high["elasticity"] == pytest.approx(3.5)
    assert not low["margin_below_host_spread"] and high["margin_below_host_spread"]
    assert out["num_margin_below_host_spread"] == 1
    assert spread([1.0, 2.0, 3.0]) == pytest.approx(0.5)


def test_validate_gives_each_committed_figures_elasticity(monkeypatch, capsys):
    """On a committed three-replica run: slower replicas raise every latency, near saturation several per cent
    for each per cent of speed; each target's machine check is counted."""
    monkeypatch.chdir(REPO)
    report = "loadtest/results/prefix-routing-fixed/step-counters/run-1/summary.json"
    assert loadtest_main(["validate", "prefix-routing-fixed", "--report", report, "--poll-phases", "1",
                          "--speed-sensitivity", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["prefix-routing-fixed"]
    out = result["speed_sensitivity"]
    assert set(out["figures"]) == {k for k in result["figures"] if not k.endswith("goodput_rps")}
    assert out["machine_checks"] == 2 and 0 < out["host_speed_spread"] < 0.5  # two targets' checks, one run
    # round robin places the same way at any speed; least_loaded reads polled stats, and from one poll phase its
    # elasticity is one draw of its placement (0.05 to 2.6 seen at 5.66 req/s)
    quiet, busy = (out["figures"][f"round_robin/{rate}/tpot_p50_ms"]["elasticity"] for rate in ("2", "5.66"))
    assert 0 < quiet < busy and busy > 1.5
