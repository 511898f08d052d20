from __future__ import annotations

import json
from pathlib import Path

import pytest
from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel, TransferModel

REPO = Path(__file__).resolve().parents[3]
PREFIX_ROUTING_RUN = REPO / "loadtest/results/prefix-routing-fixed/run-1/summary.json"


@pytest.fixture
def profile() -> LatencyProfile:
    """Round numbers: prefill 10 ms + 0.1 ms/token (+ quadratic and cached terms), decode 5 ms + 0.1 ms/row +
    1 us per context token, KV 1 KiB/token over ucx at 1 GB/s after 2 ms."""
    model = LatencyModel(PrefillModel(0.01, 1e-4, 1e-8, 2e-8), DecodeModel(0.005, 1e-4, 1e-6), 1024,
                         {"ucx": TransferModel(0.002, 1e9)})
    return LatencyProfile({"default": model})


@pytest.fixture(scope="module")
def prefix_routing_run():
    """(report, its profile, its Model at one poll phase): prefix-routing-fixed's committed run 1."""
    from pdserve.loadtest.validate import load_scenario
    from pdserve.loadtest.validation_model import Model
    from pdserve.sim.scenario import load_profile

    report = json.loads(PREFIX_ROUTING_RUN.read_text())
    profile = load_profile(str(REPO / report["machine"][0]["profile_path"]))
    model = Model(load_scenario(str(REPO / "loadtest/scenarios/prefix-routing-fixed.yaml")), report, profile,
                  poll_phases=1)
    return report, profile, model
