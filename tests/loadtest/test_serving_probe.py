"""The serving probe's requests and its record (pdserve.loadtest.serving_probe); the live probe runs in the
smoke scenario (tests/integration/test_loadtest_smoke.py)."""

from __future__ import annotations

import pytest
from pdserve.loadtest.serving_probe import ServingProbe, ServingProbeSpec, measure_serving
from pdserve.loadtest.workloads import TokenSource


@pytest.mark.parametrize("fields", [{"requests": -1}, {"prompt_len": 0}, {"output_len": 0}, {"cached_len": 0},
                                    {"cached_sends": -1}])
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
    long = ServingProbeSpec(cached_len=64, cached_sends=3).cached_specs(tokens)
    assert len(long) == 3 and len({r.prompt_ids for r in long}) == 1 and long[0].prompt_len == 64


def test_the_record_round_trips():
    sends = ((0.21, 0), (0.05, 1008), (0.22, 0), (0.06, 1008), (0.04, 1008))
    probe = ServingProbe(ServingProbeSpec(requests=3, cached_sends=5), 0.031, (0.030, 0.031, 0.035), sends)
    d = probe.to_dict()
    assert d["ttft_ms"] == pytest.approx(31.0) and d["each_ttft_ms"] == pytest.approx([30.0, 31.0, 35.0])
    assert d["cached_sends"][1] == {"ttft_ms": pytest.approx(50.0), "cached_tokens": 1008}
    back = ServingProbe.from_dict(d)
    assert back.spec == probe.spec and back.ttft_s == pytest.approx(0.031) and back.each_ttft_s == probe.each_ttft_s
    assert [c for _, c in back.sends] == [c for _, c in sends]
    assert [t for t, _ in back.sends] == pytest.approx([t for t, _ in sends])


def test_only_sends_that_found_the_prompt_cached_time_the_cached_path():
    spec = ServingProbeSpec(cached_len=1024, cached_sends=4)
    probe = ServingProbe(spec, 0.01, (0.01,), ((0.2, 0), (0.05, 1008), (0.19, 496), (0.07, 512)))
    assert probe.hits == [(0.05, 1008), (0.07, 512)]  # half the prompt or more
    assert probe.cached == (pytest.approx(0.06), 760)
    assert ServingProbe(spec, 0.01, (0.01,), ((0.2, 0),)).cached is None  # prefix caching off: no hit


def test_a_probe_that_is_off_measures_nothing():
    with pytest.raises(ValueError, match="off"):
        measure_serving("http://127.0.0.1:9", "m", TokenSource((1, 2, 3), lambda text: []), ServingProbeSpec(requests=0))
