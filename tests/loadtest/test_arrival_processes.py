"""Arrival processes: mean rate, burstiness (coefficient of variation of the gaps), determinism."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.loadtest.arrivals import Constant, Gamma, Poisson, Trace, arrival_process

N = 20_000


def gaps(process, seed: int = 0) -> np.ndarray:
    return np.diff(process.schedule(N, seed))


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_mean_rate_and_cv_one(rate):
    g = gaps(Poisson(rate))
    assert 1 / g.mean() == pytest.approx(rate, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_keeps_the_rate_and_sets_cv(burstiness):
    g = gaps(Gamma(2.0, burstiness))
    assert 1 / g.mean() == pytest.approx(2.0, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_constant_is_evenly_spaced():
    schedule = Constant(4.0).schedule(5, seed=123)
    assert schedule == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


def test_infinite_rate_sends_everything_at_once():
    assert Poisson(math.inf).schedule(4, 0) == [0.0] * 4
    assert Constant(math.inf).schedule(3, 0) == [0.0] * 3


def test_same_seed_same_schedule_other_seed_other_schedule():
    assert Poisson(3.0).schedule(50, 7) == Poisson(3.0).schedule(50, 7)
    assert Poisson(3.0).schedule(50, 7) != Poisson(3.0).schedule(50, 8)


@settings(max_examples=50, deadline=None)
@given(rate=st.floats(0.01, 1000), burstiness=st.floats(0.05, 20), n=st.integers(1, 200), seed=st.integers(0, 2**32))
def test_schedules_start_at_zero_and_never_go_back(rate, burstiness, n, seed):
    schedule = Gamma(rate, burstiness).schedule(n, seed)
    assert len(schedule) == n and schedule[0] == 0.0
    assert all(b >= a for a, b in itertools.pairwise(schedule))


def test_trace_replays_and_rescales():
    trace = Trace((0.0, 1.0, 3.0, 4.0))  # 3 gaps over 4 s: 0.75 req/s
    assert trace.native_rate == pytest.approx(0.75)
    assert trace.schedule(4, 0) == pytest.approx([0.0, 1.0, 3.0, 4.0])
    faster = Trace(trace.offsets, rate=1.5)
    assert faster.schedule(4, 0) == pytest.approx([0.0, 0.5, 1.5, 2.0])
    with pytest.raises(ValueError):
        trace.schedule(5, 0)


def test_registry_and_validation():
    assert isinstance(arrival_process("gamma", 2.0, burstiness=0.5), Gamma)
    assert isinstance(arrival_process("constant", 2.0), Constant)
    with pytest.raises(ValueError):
        arrival_process("zipf", 1.0)
    with pytest.raises(ValueError):
        Poisson(1.0, burstiness=2.0)
    with pytest.raises(ValueError):
        Gamma(0.0)
