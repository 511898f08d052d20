"""KV handed over in parts while a prefill-only prompt is still being computed.

After each step, a prefill-only sequence with `kv_part_tokens` whose computed full blocks past the last
part reach a whole part gets them leased (one more reference each, beside the sequence's own) and
emitted as a token-less delta. The blocks are immutable from then on: a prompt's full blocks are never
rewritten, and an abort or a preemption only drops the sequence's references, so a part stays readable
until its lease is released, pulled or expired. The final handoff then exports only the blocks after
the parts (`KVHandoff.num_parted_blocks`).
"""

from __future__ import annotations

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.lease import LeaseTable
from pdserve.engine.outputs import KVHandoff, TokenDelta
from pdserve.engine.sequence import Sequence


def part_tokens(kv_part_tokens: int, block_size: int) -> int:
    """Tokens per part: whole blocks, at least one."""
    return max(1, -(-kv_part_tokens // block_size)) * block_size


def take_parts(seqs: list[Sequence], block_manager: BlockManager, leases: LeaseTable) -> list[TokenDelta]:
    """Parts that `seqs` (a step's prefills) hold computed: before the step runs, a prefix-cache hit's
    blocks; after it, what the step computed. At most one part per sequence and call."""
    deltas = []
    for seq in seqs:
        if seq.kv_part_tokens is None or not seq.prefill_only or seq.num_computed_tokens >= len(seq):
            continue  # a prompt that just finished leaves its tail to the final handoff
        first = seq.num_parted_blocks
        full = min(seq.num_computed_tokens // seq.block_size, len(seq.block_table))
        if (full - first) * seq.block_size < part_tokens(seq.kv_part_tokens, seq.block_size):
            continue
        block_ids = seq.block_table[first:full]
        block_manager.share(block_ids)
        lease = leases.grant(block_ids, len(block_ids) * seq.block_size)
        hashes = tuple(seq.block_hashes[first:full])
        seq.num_parted_blocks = full
        part = KVHandoff(lease.lease_id, lease.block_ids, lease.num_tokens, hashes, first_block=first)
        deltas.append(TokenDelta(seq.request_id, (), "", kv_part=part, num_prompt_tokens=seq.num_prompt_tokens,
                                 num_prefill_chunks=seq.num_prefill_chunks))
    return deltas
