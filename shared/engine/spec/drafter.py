"""Per-sequence draft lengths: the proposer's guess, capped so a verification never overruns a limit.

The cap adapts per sequence: after a rejection the next draft is at most one longer than what was
accepted, after a fully accepted draft the cap doubles (up to num_speculative_tokens). Text that
copies keeps long drafts; chat that only matches by chance pays for about one extra row per step.
"""

from __future__ import annotations

from pdserve.config import SpeculativeConfig
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec.proposer import Proposer, create_proposer


class Drafter:
    def __init__(
        self, proposer: Proposer, num_speculative_tokens: int, max_model_len: int,
        disable_by_batch_size: int | None = None,
    ) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.disable_by_batch_size = disable_by_batch_size

    @classmethod
    def from_config(cls, config: SpeculativeConfig, max_model_len: int) -> Drafter:
        return cls(create_proposer(config), config.num_speculative_tokens, max_model_len, config.disable_by_batch_size)

    def is_enabled(self, num_running: int) -> bool:
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size

    def draft(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for a decoding sequence: its verification computes rows at positions
        len(seq) - 1 .. len(seq) - 1 + len(draft), and emits at most len(draft) + 1 tokens."""
        limit = min(
            self.num_speculative_tokens if seq.draft_limit is None else seq.draft_limit,
            budget,
            seq.params.max_tokens - seq.num_output_tokens - 1,  # the bonus token is the last one allowed
            self.max_model_len - len(seq),
        )
        if limit <= 0 or seq.prefill_only:
            return []
        draft = self.proposer.propose(seq.token_ids, limit)
        if seq.grammar is None:
            return draft
        # a constrained draft is cut where its grammar would refuse it; text the grammar forces drafts too
        draft = draft[: seq.grammar.validate(draft)]
        forced = seq.grammar.forced_tokens()[:limit]
        return forced if len(forced) > len(draft) else draft

    def observe(self, seq: Sequence, num_draft_tokens: int, num_accepted: int) -> None:
        """Adapt the sequence's draft cap to how its last verification went."""
        if num_accepted == num_draft_tokens:
            seq.draft_limit = min(self.num_speculative_tokens, 2 * max(num_draft_tokens, seq.draft_limit or 1))
        else:
            seq.draft_limit = num_accepted + 1
