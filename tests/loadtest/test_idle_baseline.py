"""pdserve.loadtest.idle_baseline: which targets it probes, and the ratios it reports (no timings)."""

from __future__ import annotations

import pytest
from pdserve.loadtest.idle_baseline import (
    DEFAULT_SCENARIO,
    OLD_TARGET,
    configured_threads,
    idle_targets,
    ratios,
    recorded_probe,
)
from pdserve.loadtest.scenario import Scenario


def test_old_colocated_target_is_no_chunking_with_one_two_cpu_replica() -> None:
    scenario = Scenario.from_yaml(DEFAULT_SCENARIO)
    targets = idle_targets(scenario)
    assert [t.name for t in targets] == [*(t.name for t in scenario.targets), OLD_TARGET]
    base = next(t for t in scenario.targets if t.name == "colocated-no-chunking")
    old = targets[-1].system
    assert old["decode"] == {**base.system["decode"], "num_replicas": 1, "num_cpus": 2}
    assert {k: v for k, v in old.items() if k != "decode"} == {k: v for k, v in base.system.items() if k != "decode"}
    assert base.system["decode"]["num_cpus"] == 1  # the scenario itself is unchanged


def test_configured_threads_follow_num_cpus() -> None:
    scenario = Scenario.from_yaml(DEFAULT_SCENARIO)
    threads = {t.name: configured_threads({"model": "tiny", **t.system}) for t in idle_targets(scenario)}
    assert threads["disaggregated"] == {"prefill": 1, "decode": 1}
    assert threads["colocated-no-chunking"] == {"decode": 1}
    assert threads[OLD_TARGET] == {"decode": 2}


def test_ratios_over_the_disaggregated_target() -> None:
    targets = {"disaggregated": {"ttft_ms_p50": 700.0, "tpot_ms_p50": 10.0},
               "colocated": {"ttft_ms_p50": 1400.0, "tpot_ms_p50": 25.0}}
    assert ratios(targets) == {"colocated": {"tpot": pytest.approx(2.5), "ttft": pytest.approx(2.0)}}


def test_recorded_probe_restores_run_load() -> None:
    from pdserve.loadtest import evaluate

    original = evaluate.run_load
    with recorded_probe() as seen:
        assert evaluate.run_load is not original and seen == []
    assert evaluate.run_load is original
