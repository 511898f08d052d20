"""One forward step's inputs as a single int64 tensor, for the driver to broadcast to the other TP ranks.

Layout (all int64):
    [T, num_decode_tokens, num_groups, num_prefills]
    input_ids[T], positions[T], slot_mapping[T]
    per decode group:  start, n, width, max_context_len, block_tables[n * width], context_lens[n]
    per prefill chunk: query_start, query_len, context_len, num_blocks, block_table[num_blocks]
Workspaces and the attention backend are each rank's own and do not travel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.models.attention import AttentionMetadata, DecodeGroup, PrefillChunk


def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    parts = [torch.tensor([input_ids.numel(), meta.num_decode_tokens, len(meta.decode_groups), len(meta.prefills)]),
             input_ids, positions, meta.slot_mapping]
    for g in meta.decode_groups:
        n, width = g.block_tables.shape
        parts += [torch.tensor([g.start, n, width, g.max_context_len]), g.block_tables.flatten(), g.context_lens]
    for c in meta.prefills:
        parts += [torch.tensor([c.query_start, c.query_len, c.context_len, c.block_table.numel()]), c.block_table]
    return torch.cat([p.to(device="cpu", dtype=torch.int64).flatten() for p in parts])


def unpack_step(
    payload: torch.Tensor, device: torch.device, backend: str,
    workspace: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids [T], positions [T], metadata); `workspace(num_blocks)` gives this rank's gather buffers."""
    values = payload.to(device)
    cursor = 0

    def take(n: int) -> torch.Tensor:
        nonlocal cursor
        cursor += n
        return values[cursor - n : cursor]

    num_tokens, num_decode, num_groups, num_prefills = take(4).tolist()
    input_ids, positions, slot_mapping = take(num_tokens), take(num_tokens), take(num_tokens)
    groups = []
    for _ in range(num_groups):
        start, n, width, max_len = take(4).tolist()
        tables = take(n * width).view(n, width)
        groups.append(DecodeGroup(start, tables, take(n), max_len))
    chunks = []
    for _ in range(num_prefills):
        query_start, query_len, context_len, num_blocks = take(4).tolist()
        chunks.append(PrefillChunk(query_start, query_len, context_len, take(num_blocks)))
    if cursor != values.numel():
        raise ValueError(f"step payload has {values.numel() - cursor} trailing values")
    needed = max((g.block_tables.numel() for g in groups), default=0)
    ws = workspace(needed) if needed and workspace is not None and backend != "triton" else None
    meta = AttentionMetadata(slot_mapping, num_decode, tuple(groups), tuple(chunks), workspace=ws, backend=backend)
    return input_ids, positions, meta
