"""One replica, deterministic service, Poisson arrivals: the M/D/1 mean wait rho / (2 mu (1 - rho))."""

from __future__ import annotations

import pytest
from pdserve.loadtest.arrivals import Poisson
from pdserve.placement.policy import PlacementConfig
from pdserve.sim import ClusterSpec, EngineSpec, RouterSpec, SimRequest, Simulation

PROMPT = 512


@pytest.mark.parametrize(("rho", "num_requests"), [(0.3, 10000), (0.6, 10000), (0.8, 20000)])
def test_mean_wait_matches_md1(profile, rho, num_requests):
    service = profile.for_role("decode").prefill_time_s(PROMPT)
    arrivals = Poisson(rho / service).schedule(num_requests, 7)
    # one output token: a request leaves at its first token; a budget of one prompt: one prompt a step
    requests = [SimRequest(i, t, PROMPT, 1) for i, t in enumerate(arrivals)]
    engine = EngineSpec(max_num_seqs=1, max_num_batched_tokens=PROMPT)
    spec = ClusterSpec(mode="colocated", decode=engine, router=RouterSpec(placement=PlacementConfig(policy="round_robin")))
    records = Simulation(spec, profile, requests).run()
    mean_wait = sum(r.ttft_s - service for r in records) / num_requests
    expected = rho * service / (2 * (1 - rho))
    assert mean_wait == pytest.approx(expected, rel=0.1)
