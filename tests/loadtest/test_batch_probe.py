"""The batch probe's requests and its record (pdserve.loadtest.batch_probe); the live probe runs in the smoke
scenario (tests/integration/test_loadtest_smoke.py)."""

from __future__ import annotations

import pytest
from pdserve.loadtest.batch_probe import BatchProbe, BatchProbeSpec, measure_batch
from pdserve.loadtest.workloads import TokenSource


@pytest.mark.parametrize("fields", [{"k": -1}, {"prompt_len": 0}, {"output_len": 1}, {"rounds": 0}])
def test_a_probe_that_cannot_measure_is_refused(fields):
    with pytest.raises(ValueError, match="batch probe"):
        BatchProbeSpec(**fields)


def test_each_round_gets_k_fresh_prompts_of_the_probes_lengths():
    tokens = TokenSource(tuple(range(100, 400)), lambda text: [])
    spec = BatchProbeSpec(k=4, prompt_len=32, output_len=64)
    first, again, second = spec.requests(tokens, 0), spec.requests(tokens, 0), spec.requests(tokens, 1)
    assert len(first) == 4 and all(r.prompt_len == 32 and r.output_len == 64 for r in first)
    assert first == again  # seeded: every target sees the same prompts
    assert len({r.prompt_ids for r in first + second}) == 8  # no prompt repeats: no prefix-cache hit


def test_the_record_round_trips():
    probe = BatchProbe(BatchProbeSpec(k=8), 0.0057, (0.0056, 0.0058))
    d = probe.to_dict()
    assert d["tpot_ms"] == pytest.approx(5.7) and d["round_tpot_ms"] == pytest.approx([5.6, 5.8])
    back = BatchProbe.from_dict(d)
    assert back.spec == probe.spec and back.tpot_s == pytest.approx(0.0057)


def test_a_probe_that_is_off_measures_nothing():
    with pytest.raises(ValueError, match="off"):
        measure_batch("http://127.0.0.1:9", "m", TokenSource((1, 2, 3), lambda text: []), BatchProbeSpec(k=0))
