import math

import pytest
import torch

from pdserve.engine.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams

NUM_DRAWS = 4000


def make_seq(params: SamplingParams, prompt=(1, 2, 3), outputs=(), eos=(), request_id="r") -> Sequence:
    seq = Sequence(request_id, list(prompt), params, 16, eos_token_ids=frozenset(eos))
    seq.token_ids.extend(outputs)
    return seq


def expected_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Reference: temperature, then top-k, then the nucleus and min-p over the top-k renormalised."""
    probs = (logits.double() / params.temperature).softmax(-1)
    order = probs.argsort(descending=True)
    kept = order[: params.top_k or len(order)]
    q = probs[kept] / probs[kept].sum()
    before = q.cumsum(0) - q
    kept = kept[(before < params.top_p) & (q >= params.min_p * q[0])]
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def draw_frequencies(logits: torch.Tensor, params: SamplingParams, seed: int = 0) -> torch.Tensor:
    seqs = [make_seq(params) for _ in range(NUM_DRAWS)]
    tokens = Sampler(seed)(logits.expand(NUM_DRAWS, -1).clone(), seqs).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[0]).double() / NUM_DRAWS


def assert_distribution(freqs: torch.Tensor, expected: torch.Tensor, n: int = NUM_DRAWS) -> None:
    outside = expected == 0
    assert freqs[outside].sum() == 0, f"tokens outside the support were sampled: {freqs}"
    support = expected[~outside]
    df = len(support) - 1
    if df == 0:
        assert freqs[~outside].item() == 1.0
        return
    chi2 = (n * (freqs[~outside] - support) ** 2 / support).sum().item()
    # Wilson-Hilferty approximation of the chi-square quantile at 1 - 1e-4
    z = 3.719
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < limit, f"chi2 {chi2:.1f} >= {limit:.1f}: {freqs.tolist()} vs {expected.tolist()}"


LOGITS = torch.tensor([0.5, 2.0, -1.0, 1.0, 0.0, -3.0, 1.5, -0.5])


def test_greedy_is_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=gen)
    greedy = [make_seq(SamplingParams(temperature=0.0)) for _ in range(8)]
    top1 = [make_seq(SamplingParams(temperature=1.5, top_k=1)) for _ in range(4)]
    sampled = [make_seq(SamplingParams(temperature=1.0)) for _ in range(4)]
    out = Sampler(0)(logits.clone(), greedy + top1 + sampled)
    assert out.token_ids[:12] == logits[:12].argmax(-1).tolist()
    assert out.logprobs == [None] * 16 and out.top_logprobs == [None] * 16


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution(temperature):
    params = SamplingParams(temperature=temperature)
    assert_distribution(draw_frequencies(LOGITS, params), expected_probs(LOGITS, params))


def test_distribution_check_can_fail():
    freqs = draw_frequencies(LOGITS, SamplingParams(temperature=0.5))
    with pytest.raises(AssertionError):
        assert_distribution(freqs, expected_probs(LOGITS, SamplingParams(temperature=0.7)))


@pytest.mark.parametrize("top_k", [1, 2, 3, 7])
def test_top_k(top_k):
    params = SamplingParams(temperature=1.3, top_k=top_k)
    expected = expected_probs(LOGITS, params)
    assert (expected > 0).sum() == top_k
    assert_distribution(draw_frequencies(LOGITS, params), expected)


@pytest.mark.parametrize(("top_p", "kept"), [(0.35, 1), (0.65, 2), (0.75, 3), (0.95, 4), (1.0, 5)])
def test_top_p_keeps_the_smallest_nucleus(top_p, kept):
    probs = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], dtype=torch.float64)
    logits = probs.log().float()
    params = SamplingParams(top_p=top_p)
    expected = expected_probs(logits, params)
    assert (expected > 0).sum() == kept
    assert_distribution(draw_frequencies(logits, params), expected)


@pytest.mark.parametrize(("min_p", "kept"), [(0.1, 5), (0.2, 4), (0.3, 3), (0.55, 2), (0.9, 1)])
def test_min_p(min_p, kept):
    probs = torch.tensor([0.1, 0.4, 0.05, 0.2, 0.25], dtype=torch.float64)
    logits = probs.log().float()
    params = SamplingParams(min_p=min_p)
    expected = expected_probs(logits, params)
    assert (expected > 0).sum() == kept
    assert_distribution(draw_frequencies(logits, params), expected)


def test_temperature_top_k_top_p_min_p_combined():
    logits = torch.linspace(3.0, -2.0, 12)[torch.randperm(12, generator=torch.Generator().manual_seed(1))]
    params = SamplingParams(temperature=0.8, top_k=8, top_p=0.9, min_p=0.05)
    expected = expected_probs(logits, params)
    assert 2 < (expected > 0).sum() < 8
    assert_distribution(draw_frequencies(logits, params, seed=3), expected)


def test_seeded_requests_sample_the_same_distribution():
    params = [SamplingParams(temperature=1.2, top_k=6, seed=i) for i in range(NUM_DRAWS)]
    seqs = [make_seq(p) for p in params]
    tokens = Sampler(0)(LOGITS.expand(NUM_DRAWS, -1).clone(), seqs).token_ids
    freqs = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double() / NUM_DRAWS
    assert_distribution(freqs, expected_probs(LOGITS, params[0]))


def test_disabled_filters_leave_rows_unchanged_in_a_filtered_batch():
    # a long flat tail: the float32 cumulative sum reaches 1.0 before the last tokens
    logits = torch.randn(8, 32000, generator=torch.Generator().manual_seed(0)) * 3
    seqs = [make_seq(SamplingParams(top_k=5 if i == 0 else 0)) for i in range(8)]
    out = apply_top_k_top_p_min_p(logits.clone(), seqs)
    assert torch.isfinite(out[0]).sum() == 5
    assert torch.equal(out[1:], logits[1:])


# --- penalties and min_tokens ----------------------------------------------------------------------


def reference_penalties(logits: list[float], seq: Sequence) -> list[float]:
    p = seq.params
    prompt, output = seq.token_ids[: seq.num_prompt_tokens], seq.output_token_ids
    out = []
    for token, x in enumerate(logits):
        if token in prompt or token in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = output.count(token)
        x -= p.presence_penalty * (count > 0) + p.frequency_penalty * count
        out.append(x)
    return out


def test_penalties_by_hand():
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.25)
    seq = make_seq(params, prompt=[1, 2, 2], outputs=[3, 3, 4])
    logits = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.5, 3.0]])
    out = apply_penalties(logits.clone(), [seq])
    # 0, 5 unseen; 1, 2 prompt only; 3 twice in the output; 4 once
    expected = [1.0, -1.5, 2.0 / 1.5, -2.0 * 1.5 - 0.5 - 0.5, 0.5 / 1.5 - 0.5 - 0.25, 3.0]
    torch.testing.assert_close(out, torch.tensor([expected]))


def test_penalties_batched_rows_of_different_lengths():
    gen = torch.Generator().manual_seed(0)
    vocab = 20
    seqs = [
        make_seq(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7), prompt=[5], outputs=[]),
        make_seq(SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5), prompt=[7, 8, 9, 10, 11],
                 outputs=[12, 12, 12, 13]),
        make_seq(SamplingParams(repetition_penalty=0.8, presence_penalty=2.0), prompt=[3, 4],
                 outputs=[4, 19, 19, 6, 2, 2, 2]),
        make_seq(SamplingParams(), prompt=[1, 2, 3], outputs=[1]),
    ]
    logits = torch.randn(len(seqs), vocab, generator=gen) * 2
    out = apply_penalties(logits.clone(), seqs)
    expected = torch.tensor([reference_penalties(row.tolist(), s) for row, s in zip(logits, seqs)])
    torch.testing.assert_close(out, expected)
    assert torch.equal(out[:, 0], logits[:, 0])  # token 0 pads the shorter rows: never penalised
    assert torch.equal(out[3], logits[3])


def test_min_tokens_masks_eos_and_stop_token_ids():
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(6,))
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5, 0.0, 5.0, 4.0, 3.0])
    seqs = [make_seq(params, outputs=[0] * n, eos=(5, 99)) for n in range(5)]
    out = Sampler(0)(logits.expand(5, -1).clone(), seqs)
    assert out.token_ids == [7, 7, 7, 5, 5]
    other_eos = make_seq(params, eos=(7,))  # 5 is not this sequence's eos
    assert Sampler(0)(logits[None].clone(), [other_eos]).token_ids == [5]


def test_min_tokens_masks_sampled_rows():
    params = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=(1,))
    seqs = [make_seq(params, eos=(6,)) for _ in range(NUM_DRAWS)]
    tokens = Sampler(0)(LOGITS.expand(NUM_DRAWS, -1).clone(), seqs).token_ids
    assert 1 not in tokens and 6 not in tokens
    masked = LOGITS.clone()
    masked[[1, 6]] = float("-inf")
    freqs = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).double() / NUM_DRAWS
    assert_distribution(freqs, expected_probs(masked, params))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(min_tokens=2, temperature=0.0),
        SamplingParams(repetition_penalty=2.0, min_tokens=2, top_k=3, logprobs=2),
    ],
)
def test_sampler_does_not_modify_the_logits(params):
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    seqs = [make_seq(params, outputs=[4], eos=(0,)) for _ in range(3)]
    before = logits.clone()
    Sampler(0)(logits, seqs)
    assert torch.equal(logits, before)


# --- seeds and logprobs ----------------------------------------------------------------------------

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)


def seeded_run(batch_of, steps: int = 12, sampler_seed: int = 0) -> list[int]:
    """Sample `steps` times from one seeded sequence placed in the batch that batch_of(step) builds."""
    gen = torch.Generator().manual_seed(42)
    rows = torch.randn(steps, 1000, generator=gen) * 0.3  # high entropy: a fixed draw is no accident
    seq = make_seq(SEEDED, request_id="seeded")
    sampler, tokens = Sampler(sampler_seed), []
    for t in range(steps):
        others_before, others_after = batch_of(t)
        batch = others_before + [seq] + others_after
        logits = torch.randn(len(batch), 1000, generator=gen)
        logits[len(others_before)] = rows[t]
        out = sampler(logits, batch)
        tokens.append(out.token_ids[len(others_before)])
        seq.token_ids.append(tokens[-1])
    return tokens


def test_seeded_request_is_independent_of_the_batch():
    alone = seeded_run(lambda t: ([], []))
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5, min_p=0.1),
        SamplingParams(seed=7, top_p=0.5),
        SamplingParams(repetition_penalty=1.2, min_tokens=3, logprobs=2),
    ]

    def mixed(t):
        rows = [make_seq(p, outputs=[t], eos=(t,)) for p in others[: t % 5 + 1]]
        return rows[: t % 3], rows[t % 3 :]

    assert seeded_run(mixed, sampler_seed=99) == alone
    assert len(set(alone)) > 6


def test_different_seeds_differ_and_twins_agree():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(5)) * 0.3
    seqs = [make_seq(SamplingParams(seed=s)) for s in (1, 2, 1, 3, 1)]
    tokens = Sampler(0)(logits.expand(5, -1).clone(), seqs).token_ids
    assert tokens[0] == tokens[2] == tokens[4]
    assert len({tokens[0], tokens[1], tokens[3]}) == 3


def test_logprobs_are_from_the_raw_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 30, generator=gen) * 2
    params = [
        SamplingParams(logprobs=3, repetition_penalty=1.4, temperature=0.7, top_k=5),
        SamplingParams(logprobs=5, temperature=0.0),
        SamplingParams(),
        SamplingParams(logprobs=0, min_tokens=2, frequency_penalty=1.0),
        SamplingParams(logprobs=20, top_p=0.5),
    ]
    seqs = [make_seq(p, outputs=[1, 2, 2], eos=(0,)) for p in params]
    raw = logits.log_softmax(-1)
    out = Sampler(0)(logits.clone(), seqs)
    for i, p in enumerate(params):
        if p.logprobs is None:
            assert out.logprobs[i] is None and out.top_logprobs[i] is None
            continue
        assert out.logprobs[i] == pytest.approx(raw[i, out.token_ids[i]].item(), abs=1e-6)
        values, ids = raw[i].topk(p.logprobs)
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(values.tolist(), abs=1e-6)
    assert out.token_ids[1] == logits[1].argmax().item()
