"""logit_bias in SamplingParams and the sampler: +100 forces a token, -100 bans it, per row."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams, params_from_dict, params_to_dict

LOGITS = torch.tensor([0.5, 2.0, -1.0, 1.0, 0.0, -3.0, 1.5, -0.5])


def _seq(params: SamplingParams, request_id: str = "r") -> Sequence:
    return Sequence(request_id, [1, 2, 3], params, 16)


def test_params_normalize_hash_and_cross_as_plain_data():
    p = SamplingParams(logit_bias={"7": 5, 3: -1.5})
    assert p.logit_bias == ((3, -1.5), (7, 5.0))
    assert hash(p) == hash(SamplingParams(logit_bias=[(7, 5.0), (3, -1.5)]))
    assert p == SamplingParams(logit_bias={7: 5.0, 3: -1.5}) != SamplingParams()
    data = params_to_dict(p)
    assert data["logit_bias"] == ((3, -1.5), (7, 5.0))
    assert params_from_dict({**data, "logit_bias": [list(x) for x in data["logit_bias"]]}) == p


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: -101}, {-1: 1.0}, {1: float("nan")}, [(1, 1.0), (1, 2.0)]])
def test_params_refuse_bad_bias(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_plus_100_forces_and_minus_100_bans(temperature):
    worst = int(LOGITS.argmin())
    best = int(LOGITS.argmax())
    forced = [_seq(SamplingParams(temperature=temperature, seed=i, logit_bias={worst: 100.0})) for i in range(16)]
    banned = [_seq(SamplingParams(temperature=temperature, seed=i, logit_bias={best: -100.0})) for i in range(16)]
    plain = [_seq(SamplingParams(temperature=0.0))]
    out = Sampler(0)(LOGITS.expand(33, -1).clone(), forced + banned + plain)
    assert out.token_ids[:16] == [worst] * 16
    assert best not in out.token_ids[16:32]
    assert out.token_ids[32] == best  # an unbiased row in the same batch is untouched


def test_bias_does_not_change_reported_logprobs_and_ignores_ids_past_vocab():
    params = SamplingParams(temperature=0.0, logprobs=1, logit_bias={0: 100.0, 10_000: 100.0})
    out = Sampler(0)(LOGITS[None].clone(), [_seq(params)])
    assert out.token_ids == [0]
    assert out.logprobs[0] == pytest.approx(LOGITS.log_softmax(-1)[0].item())  # the model's own logprob
