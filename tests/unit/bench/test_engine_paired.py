"""`pdserve bench engine`'s paired roofline rounds (pdserve.bench.engine_paired) on the tiny model: every
round reads the bandwidth around its own request, and its fraction is against the higher of the two.
No timing asserted."""

from __future__ import annotations

import pytest

from pdserve.bench.engine_paired import bandwidth_probe, decode_steps_tok_s, paired_fractions, paired_roofline
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLM
from pdserve.sampling_params import SamplingParams


def _llm() -> LLM:
    return LLM(EngineConfig(model="tiny", device="cpu", dtype="float32", quantization="int8",
                            cache=CacheConfig(num_blocks=16, enable_prefix_caching=False)))


@pytest.mark.parametrize("runs, median, low, high", [
    ([(100.0, [10.0, 20.0])], 0.5, 0.5, 0.5),  # 100 tok/s x 100 MB = 10 GB/s against the higher reading, 20
    ([(100.0, [10.0, 20.0]), (100.0, [40.0, 5.0]), (300.0, [30.0, 30.0])], 0.5, 0.25, 1.0),
])
def test_each_round_counts_against_its_higher_reading(runs, median, low, high):
    result = paired_fractions([{"decode_tok_s": t, "bw_gb_s": bw} for t, bw in runs], 100_000_000)
    assert (result["median"], result["min"], result["max"]) == (median, low, high)
    assert [r["bw_gb_s"] for r in result["rounds"]] == [bw for _, bw in runs]


def test_rounds_read_the_bandwidth_around_their_own_request_and_leave_the_engine_as_it_was():
    llm = _llm()
    prompt = list(range(10, 42))
    readings: list[float] = []
    probe = bandwidth_probe(64 << 20)

    def recorded() -> float:
        readings.append(probe())
        return readings[-1]

    result = paired_roofline(llm, prompt, 9, 50_000_000, recorded, rounds=3)
    assert len(result["rounds"]) == 3 and len(readings) == 6 and all(r > 0 for r in readings)
    for i, run in enumerate(result["rounds"]):
        assert run["bw_gb_s"] == [round(readings[2 * i], 2), round(readings[2 * i + 1], 2)]
        assert run["fraction"] == round(run["decode_tok_s"] * 0.05 / max(run["bw_gb_s"]), 3)
    assert result["min"] <= result["median"] <= result["max"]
    assert not llm.engine.has_unfinished()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert llm.generate([prompt], params)[0].token_ids == _llm().generate([prompt], params)[0].token_ids


def test_a_request_with_no_decode_step_is_refused():
    with pytest.raises(ValueError, match="two output tokens"):
        paired_roofline(_llm(), [1, 2, 3], 1, 1, lambda: 1.0)
    assert decode_steps_tok_s(_llm(), [1, 2, 3], 3, "r") > 0


def test_a_prompt_over_the_step_budget_counts_only_steps_after_its_first_token(monkeypatch):
    """A 40-token prompt in 16-token chunks takes three steps to its first token; on a clock that gives each
    of those 10 s and each later step 1 s, the rate is the 4 decode steps over 4 s."""
    from pdserve.bench import engine_paired

    llm = LLM(EngineConfig(model="tiny", device="cpu", dtype="float32",
                           cache=CacheConfig(num_blocks=16, enable_prefix_caching=False),
                           scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16)))
    clock = {"now": 0.0, "steps": 0}
    step = llm.engine.step

    def stepped():
        clock["steps"] += 1
        clock["now"] += 10.0 if clock["steps"] <= 3 else 1.0
        return step()

    monkeypatch.setattr(llm.engine, "step", stepped)
    monkeypatch.setattr(engine_paired.time, "perf_counter", lambda: clock["now"])
    assert decode_steps_tok_s(llm, list(range(10, 50)), 5, "chunked") == 1.0
    assert clock["steps"] == 3 + 4
