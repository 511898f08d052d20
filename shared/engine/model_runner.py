"""Owns the model and the KV pool; turns a scheduled batch into tensors, runs it, returns logits."""

from __future__ import annotations

import torch

from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.kernels import attention_backend
from pdserve.models.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from pdserve.kvcache.pool import allocate_pool
from pdserve.models.config import ModelConfig


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return config.kv_bytes_per_token * block_size * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, config: ModelConfig, block_size: int, num_blocks: int,
        dtype: torch.dtype, device: str, attention_override: str | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        # One contiguous region per block (all layers, K and V), so a block moves as one buffer.
        # kv_pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        self.kv_pool = allocate_pool(
            (num_blocks, config.num_layers, 2, block_size, config.num_kv_heads, config.head_dim), dtype, self.device,
        )
        self.kv_caches = [(self.kv_pool[:, i, 0], self.kv_pool[:, i, 1]) for i in range(config.num_layers)]
        self.workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self.attention_backend = attention_backend(str(self.device), override=attention_override)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Returns the sequences that reach their last token this step and their logits [N, V]."""
        input_ids, positions, slots, sample_rows, sampling = [], [], [], [], []
        bs = self.block_size
        decodes = sorted(batch.decodes, key=len)  # similar lengths share a padded gather
        for seq in decodes:
            pos = len(seq) - 1
            input_ids.append(seq.last_token_id)
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            sample_rows.append(len(input_ids) - 1)
            sampling.append(seq)
        chunks = []
        for seq, num_new in batch.prefills:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            query_start = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            chunks.append(PrefillChunk(query_start, num_new, end, torch.tensor(table, dtype=torch.int64, device=self.device)))
            if end == len(seq):
                sample_rows.append(len(input_ids) - 1)
                sampling.append(seq)
        meta = self._metadata(decodes, slots, chunks)
        to = dict(dtype=torch.int64, device=self.device)
        hidden = self.model(torch.tensor(input_ids, **to), torch.tensor(positions, **to), self.kv_caches, meta)
        if not sampling:
            return [], hidden.new_empty(0, self.config.vocab_size)
        if len(sample_rows) != hidden.shape[0]:
            hidden = hidden[torch.tensor(sample_rows, **to)]
        return sampling, self.model.compute_logits(hidden)

    def _metadata(self, decodes: list[Sequence], slots: list[int], chunks: list[PrefillChunk]) -> AttentionMetadata:
        to = dict(dtype=torch.int64, device=self.device)
        groups = []
        # the triton kernel handles mixed lengths itself; the torch path groups to cut padding
        triton = self.attention_backend == "triton"
        num_groups = 1 if triton or len(decodes) <= 8 else min(4, len(decodes) // 8)
        bounds = [round(i * len(decodes) / num_groups) for i in range(num_groups + 1)]
        for start, end in zip(bounds, bounds[1:]):
            members = decodes[start:end]
            if not members:
                continue
            width = max(len(s.block_table) for s in members)
            tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in members], **to)
            lens = torch.tensor([len(s) for s in members], **to)
            groups.append(DecodeGroup(start, tables, lens, max(len(s) for s in members)))
        needed = max((g.block_tables.numel() for g in groups), default=0)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, **to),
            num_decode_tokens=len(decodes),
            decode_groups=tuple(groups),
            prefills=tuple(chunks),
            workspace=self._workspace(needed) if needed and not triton else None,
            backend=self.attention_backend,
        )

    def _workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.workspace is None or self.workspace[0].shape[0] < num_blocks:
            shape = (max(num_blocks, 64) * 3 // 2, *self.kv_pool.shape[3:])
            kw = dict(dtype=self.kv_pool.dtype, device=self.device)
            self.workspace = (torch.empty(shape, **kw), torch.empty(shape, **kw))
        return self.workspace
