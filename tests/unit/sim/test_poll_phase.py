"""Where the routers' polls fall against the arrivals (`RouterSpec.poll_phase`), and the median over phases
that `pdserve-loadtest validate` predicts with."""

from __future__ import annotations

import pytest
from pdserve.placement.policy import PlacementConfig
from pdserve.sim.cluster import Simulation
from pdserve.sim.config import ClusterSpec, RouterSpec, SimRequest
from pdserve.sim.results import median_aggregate


class _Polls(Simulation):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.polls: list[tuple[int, float]] = []

    def _poll(self, k: int) -> None:
        self.polls.append((k, round(self.now, 9)))
        super()._poll(k)


def _polls(profile, num_routers: int, phase: float) -> list[tuple[int, float]]:
    router = RouterSpec(num_routers=num_routers, poll_phase=phase,
                        placement=PlacementConfig(policy="least_loaded", stats_poll_period_s=0.1))
    sim = _Polls(ClusterSpec(mode="colocated", num_decode=2, router=router), profile,
                 [SimRequest(0, 0.0, 200, 40)])
    sim.run()
    return sim.polls[:5]


def test_phase_zero_polls_at_the_first_arrival_as_before(profile):
    assert _polls(profile, 1, 0.0)[:3] == [(0, 0.0), (0, 0.1), (0, 0.2)]


def test_a_later_phase_keeps_an_idle_snapshot_and_shifts_every_poll(profile):
    assert _polls(profile, 1, 0.25)[:4] == [(0, 0.0), (0, 0.025), (0, 0.125), (0, 0.225)]


def test_several_routers_stay_staggered_over_the_period_at_any_phase(profile):
    polls = _polls(profile, 2, 0.5)
    assert polls[:2] == [(0, 0.0), (1, 0.0)]  # each router's snapshot before the first request
    assert polls[2:] == [(0, 0.025), (1, 0.075), (0, 0.125)]


@pytest.mark.parametrize("phase", [-0.1, 1.0, 1.5])
def test_a_phase_outside_one_period_is_refused(phase):
    with pytest.raises(ValueError, match="poll_phase"):
        RouterSpec(poll_phase=phase)


def test_the_median_is_taken_per_figure_and_keeps_what_is_not_a_number():
    points = [{"rate": 1.0, "ttft_p90_s": 0.3, "tpot_p90_s": None, "ok": True, "name": "a"},
              {"rate": 1.0, "ttft_p90_s": 0.1, "tpot_p90_s": 0.02, "ok": False, "name": "b"},
              {"rate": 1.0, "ttft_p90_s": 0.2, "tpot_p90_s": 0.04, "ok": False, "name": "c"}]
    assert median_aggregate(points) == {"rate": 1.0, "ttft_p90_s": 0.2, "tpot_p90_s": pytest.approx(0.03),
                                        "ok": True, "name": "a"}
    assert median_aggregate(points[:1])["tpot_p90_s"] is None
