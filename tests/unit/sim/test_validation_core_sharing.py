"""`pdserve-loadtest validate --core-sharing`: how the model's steps share the report's host's cores, and
`auto`, the default, which picks continuous sharing where the step counters measure the wake-up wait."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdserve.loadtest.cli import main as loadtest_main

REPO = Path(__file__).resolve().parents[3]


def test_core_sharing_is_a_choice_of_the_model_not_of_the_measurement(monkeypatch, capsys):
    """On the committed three-replica runs (three one-thread replicas on two cores), `continuous` re-rates
    steps in flight as others start and end: other predictions against the same measurements."""
    monkeypatch.chdir(REPO)
    runs = {}
    for sharing in ("step", "continuous"):
        assert loadtest_main(["validate", "prefix-routing-fixed", "--core-sharing", sharing, "--poll-phases",
                              "1", "--json"]) == 0
        runs[sharing] = json.loads(capsys.readouterr().out)["prefix-routing-fixed"]
        assert runs[sharing]["core_sharing"] == sharing
    figure = "least_loaded/5.66/ttft_p90_ms"
    assert runs["step"]["figures"][figure]["measured"] == runs["continuous"]["figures"][figure]["measured"]
    assert runs["step"]["figures"][figure]["predicted"] != runs["continuous"]["figures"][figure]["predicted"]
    with pytest.raises(SystemExit) as exit_:
        loadtest_main(["validate", "prefix-routing-fixed", "--core-sharing", "fair"])
    assert exit_.value.code == 2 and "--core-sharing" in capsys.readouterr().err


def test_auto_core_sharing_is_continuous_where_the_counters_measure_the_wake_up_wait():
    from pdserve.loadtest.validate import load_scenario
    from pdserve.loadtest.validation_model import Model
    from pdserve.sim.scenario import load_profile

    scenario = load_scenario(str(REPO / "loadtest/scenarios/prefix-routing-fixed.yaml"))
    profile = load_profile(str(REPO / "loadtest/scenarios/profiles/random-llama-h512-l4.json"))
    results = REPO / "loadtest/results/prefix-routing-fixed"
    counted = json.loads((results / "counters-2/run-1/summary.json").read_text())
    uncounted = json.loads((results / "run-1/summary.json").read_text())
    target = counted["targets"][0]
    assert min(target["points"], key=lambda p: p["rate"]).get("engine_steps")
    assert Model(scenario, counted, profile).spec(target).core_sharing == "continuous"  # auto, the default
    for model in (Model(scenario, counted, profile, core_sharing="auto", wake_wait="off"),
                  Model(scenario, counted, profile, core_sharing="auto", serving_cost="step"),
                  Model(scenario, counted, profile, core_sharing="step")):
        assert model.spec(target).core_sharing == "step"
    assert Model(scenario, uncounted, profile, core_sharing="auto").spec(uncounted["targets"][0]).core_sharing == "step"
    with pytest.raises(ValueError, match="core sharing 'fair'"):
        Model(scenario, counted, profile, core_sharing="fair")
