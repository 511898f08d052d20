"""The serving probe's requests and its record (pdserve.loadtest.serving_probe); the live probe runs in the
smoke scenario (tests/integration/test_loadtest_smoke.py)."""

from __future__ import annotations

import pytest
from pdserve.loadtest.serving_probe import ServingProbe, ServingProbeSpec, measure_serving
from pdserve.loadtest.workloads import TokenSource


@pytest.mark.parametrize("fields", [{"requests": -1}, {"prompt_len": 0}, {"output_len": 0}])
def test_a_probe_that_cannot_measure_is_refused(fields):
    with pytest.raises(ValueError, match="serving probe"):
        ServingProbeSpec(**fields)


def test_a_warm_up_and_then_fresh_short_prompts():
    tokens = TokenSource(tuple(range(100, 400)), lambda text: [])
    spec = ServingProbeSpec(requests=4, prompt_len=16, output_len=2)
    specs = spec.specs(tokens)
    assert len(specs) == 5 and all(r.prompt_len == 16 and r.output_len == 2 for r in specs)
    assert specs == spec.specs(tokens)  # seeded: every target sees the same prompts
    assert len({r.prompt_ids for r in specs}) == 5  # no prompt repeats: no prefix-cache hit


def test_the_record_round_trips():
    probe = ServingProbe(ServingProbeSpec(requests=3), 0.031, (0.030, 0.031, 0.035))
    d = probe.to_dict()
    assert d["ttft_ms"] == pytest.approx(31.0) and d["each_ttft_ms"] == pytest.approx([30.0, 31.0, 35.0])
    back = ServingProbe.from_dict(d)
    assert back.spec == probe.spec and back.ttft_s == pytest.approx(0.031) and back.each_ttft_s == probe.each_ttft_s


def test_a_probe_that_is_off_measures_nothing():
    with pytest.raises(ValueError, match="off"):
        measure_serving("http://127.0.0.1:9", "m", TokenSource((1, 2, 3), lambda text: []), ServingProbeSpec(requests=0))
