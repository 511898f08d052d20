"""Acceptance of draft tokens against the target model's rows.

Greedy rows accept the longest draft prefix equal to the target's argmax, then take the argmax at
the first mismatch (or after the whole draft): token for token what decoding without drafts emits.
Sampled rows use speculative sampling with a point-mass draft q = delta(d): accept d with probability
p(d); on rejection sample from the residual max(p - q, 0), i.e. p without d, renormalised; after a
fully accepted draft sample the bonus token from p. Each emitted token is then distributed as p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.model_runner import VerifyRows
from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import OutputTokens, Sequence
from pdserve.structured import Matcher
from pdserve.structured.bitmask import MaskSnapshot, draft_bitmask


class DraftView(OutputTokens):
    """A sequence as if `extra` tokens had been appended: what the sampler sees for a draft row."""

    __slots__ = ("params", "token_ids", "num_prompt_tokens", "num_resumed_tokens", "eos_token_ids", "generator",
                 "grammar")

    def __init__(self, seq: Sequence, extra: list[int], grammar: Matcher | None = None) -> None:
        self.params = seq.params
        self.token_ids = seq.token_ids + extra
        self.num_prompt_tokens = seq.num_prompt_tokens
        self.num_resumed_tokens = seq.num_resumed_tokens
        self.eos_token_ids = seq.eos_token_ids
        self.generator = seq.generator
        self.grammar = grammar  # a constrained row's mask after `extra`


@dataclass(frozen=True)
class Verified:
    seq: Sequence
    token_ids: list[int]  # the accepted draft tokens, then one token of the target's
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    num_draft_tokens: int

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def verify(sampler: Sampler, rows: list[VerifyRows]) -> list[Verified]:
    views = [view for r in rows for view in _views(r)]
    # logits: [sum(len(draft) + 1), V]
    raw, processed = sampler.process(torch.cat([r.logits for r in rows]), views)
    greedy = processed.argmax(dim=-1).tolist()
    sampled_rows = [i for i, v in enumerate(views) if not v.params.is_greedy]
    probs = {}
    if sampled_rows:
        dist = sampler.probabilities(processed[sampled_rows], [views[i] for i in sampled_rows])
        probs = {row: dist[i] for i, row in enumerate(sampled_rows)}
    out, offset = [], 0
    for r in rows:
        n = len(r.draft) + 1
        if r.seq.params.is_greedy:
            tokens = _accept_greedy(r.draft, greedy[offset : offset + n])
        else:
            generator = r.seq.generator or sampler.generator
            tokens = _accept_sampled(r.draft, [probs[offset + i] for i in range(n)], generator)
        if raw is None:
            logprobs, tops = [None] * len(tokens), [None] * len(tokens)
        else:
            logprobs, tops = sampler._logprobs(raw[offset : offset + len(tokens)], tokens, [r.seq.params] * len(tokens))
        out.append(Verified(r.seq, tokens, logprobs, tops, len(r.draft)))
        offset += n
    return out


def _views(row: VerifyRows) -> list[DraftView]:
    """One view per verification row; a constrained row's view carries the grammar's mask at its position."""
    if row.seq.grammar is None:
        return [DraftView(row.seq, row.draft[:i]) for i in range(len(row.draft) + 1)]
    masks = draft_bitmask(row.seq.grammar, row.draft, row.logits.shape[-1])
    return [DraftView(row.seq, row.draft[:i], MaskSnapshot(masks[i])) for i in range(len(row.draft) + 1)]


def _accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    for i, token in enumerate(draft):
        if targets[i] != token:
            return draft[:i] + [targets[i]]
    return draft + [targets[len(draft)]]


def _accept_sampled(draft: list[int], probs: list[torch.Tensor], generator: torch.Generator) -> list[int]:
    # probs: len(draft) + 1 rows, each [V]
    for i, token in enumerate(draft):
        p = probs[i]
        if torch.rand((), generator=generator).item() < p[token].item():
            continue
        residual = p.clone()
        residual[token] = 0.0
        return draft[:i] + [_sample(residual, generator)]
    return draft + [_sample(probs[len(draft)], generator)]


def _sample(weights: torch.Tensor, generator: torch.Generator) -> int:
    # argmax of w / E, E ~ Exp(1): a draw proportional to w (unnormalised)
    noise = torch.empty(weights.shape[0]).exponential_(generator=generator).to(weights.device)
    return int((weights / noise).argmax())
