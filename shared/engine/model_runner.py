"""Owns the model and the KV pool; turns a scheduled batch into tensors, runs it, returns logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence
from pdserve.kernels import attention_backend
from pdserve.models.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from pdserve.kvcache.quant import allocate_kv_cache, kv_block_nbytes
from pdserve.models.config import ModelConfig


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    return kv_block_nbytes(config, block_size, dtype, kv_cache_dtype)


@dataclass(frozen=True)
class VerifyRows:
    """Logits of a decode verifying draft tokens: row i follows the sequence plus draft[:i]."""

    seq: Sequence
    draft: list[int]
    logits: torch.Tensor  # [len(draft) + 1, V]


@dataclass(frozen=True)
class PromptRows:
    """Logits of a prefill chunk's rows for a sequence asking for prompt logprobs."""

    seq: Sequence
    start: int  # position of the first row; row i predicts prompt token start + i + 1
    logits: torch.Tensor  # [n, V]


class ModelRunner:
    def __init__(
        self, model: torch.nn.Module, config: ModelConfig, block_size: int, num_blocks: int,
        dtype: torch.dtype, device: str, attention_override: str | None = None, kv_cache_dtype: str = "auto",
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        # One contiguous region per block (all layers, K and V, scales when quantized), so a block moves as
        # one buffer. kv_pool: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (auto), else
        # [num_blocks, block_nbytes] uint8 (pdserve.kvcache.quant)
        self.kv_cache_dtype = kv_cache_dtype
        self.dtype = dtype
        self.kv_pool, self.kv_caches = allocate_kv_cache(config, block_size, num_blocks, dtype, kv_cache_dtype, self.device)
        self.workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self.attention_backend = attention_backend(str(self.device), override=attention_override)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor, list[PromptRows], list[VerifyRows]]:
        """The sequences that reach their last token this step and their logits [N, V]; for sequences
        owing prompt logprobs, their chunk's prompt rows (only theirs: nobody else pays for extra rows);
        and for decodes with drafts, their len(draft) + 1 rows (run as a chunk over the paged cache)."""
        input_ids, positions, slots, sample_rows, sampling = [], [], [], [], []
        prompt_rows: list[tuple[Sequence, int, range]] = []  # (seq, first position, batch rows)
        bs = self.block_size
        decodes = sorted((s for s in batch.decodes if s not in batch.drafts), key=len)  # similar lengths share a gather
        for seq in decodes:
            pos = len(seq) - 1
            input_ids.append(seq.last_token_id)
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            sample_rows.append(len(input_ids) - 1)
            sampling.append(seq)
        chunks = []
        verify_rows: list[tuple[Sequence, list[int], range]] = []
        for seq, draft in batch.drafts.items():
            start, end = len(seq) - 1, len(seq) + len(draft)
            query_start = len(input_ids)
            input_ids.append(seq.last_token_id)
            input_ids.extend(draft)
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            chunks.append(PrefillChunk(query_start, end - start, end, torch.tensor(table, dtype=torch.int64, device=self.device)))
            verify_rows.append((seq, draft, range(query_start, query_start + end - start)))
        for seq, num_new in batch.prefills:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            query_start = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            chunks.append(PrefillChunk(query_start, num_new, end, torch.tensor(table, dtype=torch.int64, device=self.device)))
            if seq.wants_prompt_logprobs:
                # row p predicts token p + 1: rows for the prompt tokens not recorded yet
                first, last = max(start, len(seq.prompt_logprobs) - 1), min(end, seq.num_prompt_tokens - 1)
                if first < last:
                    prompt_rows.append((seq, first, range(query_start + first - start, query_start + last - start)))
            if end == len(seq):
                sample_rows.append(len(input_ids) - 1)
                sampling.append(seq)
        meta = self._metadata(decodes, slots, chunks)
        to = dict(dtype=torch.int64, device=self.device)
        hidden = self.model(torch.tensor(input_ids, **to), torch.tensor(positions, **to), self.kv_caches, meta)
        extras = prompt_rows + verify_rows
        rows = sample_rows + [r for _, _, extra in extras for r in extra]
        if not rows:
            return [], hidden.new_empty(0, self.config.vocab_size), [], []
        if extras or len(rows) != hidden.shape[0]:  # with extra rows, `rows` is not in batch order
            hidden = hidden[torch.tensor(rows, **to)]
        logits = self.model.compute_logits(hidden)
        out, offset = [], len(sample_rows)
        for seq, first, extra in prompt_rows:
            out.append(PromptRows(seq, first, logits[offset : offset + len(extra)]))
            offset += len(extra)
        verify = []
        for seq, draft, extra in verify_rows:
            verify.append(VerifyRows(seq, draft, logits[offset : offset + len(extra)]))
            offset += len(extra)
        return sampling, logits[: len(sample_rows)], out, verify

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
            # gathered (quantized pools: dequantized) blocks in the model dtype: [n, block_size, Hkv, D]
            shape = (max(num_blocks, 64) * 3 // 2, self.block_size, self.config.num_kv_heads, self.config.head_dim)
            kw = dict(dtype=self.dtype, device=self.device)
            self.workspace = (torch.empty(shape, **kw), torch.empty(shape, **kw))
        return self.workspace
