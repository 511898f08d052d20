"""Speculative sampling keeps the target distribution: chi-square tests over the acceptance rule."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pdserve.engine.model_runner import VerifyRows
from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec.verify import DraftView, verify
from pdserve.sampling_params import SamplingParams

VOCAB = 6
NUM_TRIALS = 5000
# chi-square critical values at p = 0.001 by degrees of freedom (a correct rule fails 1 run in 1000)
CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def chi_square(counts: Counter, probs: torch.Tensor) -> tuple[float, int]:
    n = sum(counts.values())
    support = [t for t in range(len(probs)) if probs[t] > 0]
    assert all(t in support for t in counts), "a token outside the target's support was emitted"
    stat = sum((counts.get(t, 0) - n * float(probs[t])) ** 2 / (n * float(probs[t])) for t in support)
    return stat, len(support) - 1


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=16),
    SamplingParams(temperature=0.7, top_k=4, max_tokens=16),
    SamplingParams(temperature=1.3, top_p=0.9, repetition_penalty=1.3, max_tokens=16),
])
def test_each_emitted_token_follows_the_target_distribution(params):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=gen)  # rows for draft [d0, d1]: 2 drafts + bonus
    draft = [1, 3]
    logits[0, draft[0]] = logits[0].max() + 1.0  # likely enough that every position is reached often
    logits[1, draft[1]] = logits[1].max() + 1.0
    seq = Sequence("r", [0, 1, 2, 0, 1], params, 4)
    sampler = Sampler(seed=1)
    views = [DraftView(seq, draft[:i]) for i in range(3)]
    _, processed = sampler.process(logits.clone(), views)
    target = sampler.probabilities(processed, views)  # [3, V]: what plain decoding samples from at each row
    first, second, bonus = Counter(), Counter(), Counter()
    for _ in range(NUM_TRIALS):
        tokens = verify(sampler, [VerifyRows(seq, draft, logits)])[0].token_ids
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1
            if tokens[1] == draft[1]:
                bonus[tokens[2]] += 1
    # both branches of the rule ran, at each position
    assert 0 < first[draft[0]] < NUM_TRIALS and 0 < second[draft[1]] < sum(second.values())
    for counts, probs in ((first, target[0]), (second, target[1]), (bonus, target[2])):
        assert sum(counts.values()) > 300
        stat, dof = chi_square(counts, probs)
        assert stat < CRITICAL[dof], (stat, dof, counts, probs)


def test_point_mass_draft_certain_under_the_target_is_always_accepted():
    logits = torch.full((2, VOCAB), -1e4)
    logits[0, 2] = 0.0
    seq = Sequence("r", [0, 1], SamplingParams(temperature=1.0, max_tokens=8), 4)
    for _ in range(50):
        tokens = verify(Sampler(), [VerifyRows(seq, [2], logits)])[0].token_ids
        assert tokens[0] == 2 and len(tokens) == 2


def test_seeded_acceptance_is_reproducible():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=8)

    def tokens():
        seq = Sequence("r", [0, 1], params, 4)
        return [verify(Sampler(seed=i), [VerifyRows(seq, [1, 2, 3], logits)])[0].token_ids for i in range(20)]

    assert tokens() == tokens()  # the request's own generator, not the sampler's
