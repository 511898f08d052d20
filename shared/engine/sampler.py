"""Batched sampling: penalties, logit bias, min_tokens masking, grammar masks (response_format), temperature,
top-k, top-p, min-p, logprobs.

Randomness uses the exponential-race trick (argmax of p / E with E ~ Exp(1)); each seeded
request draws its noise from its own generator, so its tokens do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.sequence import Sequence
from pdserve.structured.bitmask import apply_grammar_masks


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # logprob of the sampled token, for rows that asked
    top_logprobs: list[list[tuple[int, float]] | None]


def _pad(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(r) for r in rows))
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
        valid[i, : len(row)] = True
    return ids.to(device), valid.to(device)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    # logits: [N, V] float32 -> penalized copy
    n, vocab = logits.shape
    device = logits.device
    out_ids, out_valid = _pad([s.penalized_token_ids for s in seqs], device)
    counts = torch.zeros(n, vocab + 1, dtype=logits.dtype, device=device)
    counts.scatter_add_(1, torch.where(out_valid, out_ids, vocab), out_valid.to(logits.dtype))
    counts = counts[:, :vocab]
    prompt_ids, prompt_valid = _pad([s.token_ids[: s.num_prompt_tokens - s.num_resumed_tokens] for s in seqs], device)
    seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=device)
    seen.scatter_(1, torch.where(prompt_valid, prompt_ids, vocab), True)
    seen = seen[:, :vocab] | (counts > 0)
    rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=device)[:, None]
    presence = torch.tensor([s.params.presence_penalty for s in seqs], device=device)[:, None]
    frequency = torch.tensor([s.params.frequency_penalty for s in seqs], device=device)[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - presence * (counts > 0) - frequency * counts


def apply_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    # logits: [N, V] -> biased copy; ids past the vocabulary are ignored (admission refuses them)
    rows, cols, values = [], [], []
    for i, seq in enumerate(seqs):
        for token_id, bias in seq.params.logit_bias:
            if token_id < logits.shape[1]:
                rows.append(i)
                cols.append(token_id)
                values.append(bias)
    logits = logits.clone()
    if rows:
        logits[rows, cols] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return logits


def mask_stop_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    for i, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens:
            banned = set(seq.params.stop_token_ids) | set(seq.eos_token_ids)
            banned = [t for t in banned if t < logits.shape[1]]
            if banned:
                logits[i, banned] = float("-inf")


def apply_top_k_top_p_min_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    vocab = logits.shape[1]
    device = logits.device
    top_k = torch.tensor([s.params.top_k if 0 < s.params.top_k < vocab else vocab for s in seqs], device=device)
    top_p = torch.tensor([s.params.top_p for s in seqs], device=device)
    min_p = torch.tensor([s.params.min_p for s in seqs], device=device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    remove = ranks >= top_k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # keep a token if the mass strictly before it is below top_p (the first token always stays);
    # top_p == 1 keeps all: a float32 cumsum can reach 1.0 before the tail
    remove |= ((probs.cumsum(dim=-1) - probs) >= top_p[:, None]) & (top_p[:, None] < 1.0)
    remove |= probs < (min_p[:, None] * probs[:, :1])
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        # logits: [N, V] float32, one row per sequence in `seqs`
        params = [s.params for s in seqs]
        raw_logprobs, logits = self.process(logits, seqs)
        greedy_tokens = logits.argmax(dim=-1)
        if all(p.is_greedy for p in params):
            tokens = greedy_tokens
        else:
            probs = self.probabilities(logits, seqs)
            sampled = (probs / self._exponential_noise(seqs, probs)).argmax(dim=-1)
            is_greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
            tokens = torch.where(is_greedy, greedy_tokens, sampled)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, *self._logprobs(raw_logprobs, token_list, params))

    @staticmethod
    def process(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(raw logprobs if any row asks for logprobs, logits after penalties, bias, min_tokens masking and
        grammar masks). A row's sequence may be any object with Sequence's token attributes (a draft-extended
        view). Unconstrained batches pay nothing for grammars."""
        params = [s.params for s in seqs]
        raw_logprobs = logits.log_softmax(dim=-1) if any(p.logprobs is not None for p in params) else None
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits, seqs)
        if any(p.logit_bias for p in params):
            logits = apply_logit_bias(logits, seqs)
        if any(s.num_output_tokens < s.params.min_tokens for s in seqs):
            logits = logits.clone()
            mask_stop_tokens(logits, seqs)
        if any(s.grammar is not None for s in seqs):
            logits = apply_grammar_masks(logits, seqs)
        return raw_logprobs, logits

    @staticmethod
    def probabilities(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The sampling distribution of processed logits [N, V]: temperature, then top-k / top-p / min-p."""
        params = [s.params for s in seqs]
        temperature = torch.tensor([p.temperature if not p.is_greedy else 1.0 for p in params], device=logits.device)
        scaled = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params):
            scaled = apply_top_k_top_p_min_p(scaled, seqs)
        return scaled.softmax(dim=-1)

    @staticmethod
    def skip(generator: torch.Generator, num_tokens: int, vocab_size: int) -> None:
        """Advances a seeded request's generator past `num_tokens` sampled elsewhere (a noise row each)."""
        for _ in range(num_tokens):
            torch.empty(vocab_size).exponential_(generator=generator)

    def _exponential_noise(self, seqs: list[Sequence], probs: torch.Tensor) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, s in enumerate(seqs) if s.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=self.generator).to(probs.device)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[i] = torch.empty(probs.shape[1]).exponential_(generator=seq.generator).to(probs.device)
        return noise

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], params) -> tuple[list, list]:
        n = len(tokens)
        if raw is None:
            return [None] * n, [None] * n
        chosen = raw.gather(1, torch.tensor(tokens, device=raw.device)[:, None]).squeeze(1).tolist()
        max_top = max((p.logprobs or 0) for p in params)
        top_values, top_ids = raw.topk(max_top, dim=-1) if max_top else (None, None)
        logprobs, tops = [], []
        for i, p in enumerate(params):
            if p.logprobs is None:
                logprobs.append(None)
                tops.append(None)
                continue
            logprobs.append(chosen[i])
            k = p.logprobs
            tops.append(list(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist())) if k else [])
        return logprobs, tops


def prompt_logprobs(
    logits: torch.Tensor, targets: list[int], k: int
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """(logprob of each target, the top k (token id, logprob)) under the raw model distribution of each row.
    logits: [n, V], one row per target."""
    raw = logits.float().log_softmax(dim=-1)
    chosen = raw.gather(1, torch.tensor(targets, device=raw.device)[:, None]).squeeze(1).tolist()
    if not k:
        return [(lp, ()) for lp in chosen]
    top_values, top_ids = raw.topk(k, dim=-1)
    tops = [tuple(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
    return list(zip(chosen, tops))
