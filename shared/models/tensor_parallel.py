"""Tensor parallelism as a transform of a finished model (gpt-fast style).

`shard_model` slices a loaded Llama-family model in place for one rank:
- column-parallel: qkv_proj by head ranges of q, k and v; gate_up_proj by ranges of the intermediate size;
- row-parallel: o_proj and down_proj by the matching input rows, each followed by an all-reduce
  (`AllReduce`) so every rank holds the full hidden state after attention and after the MLP.

Heads need not divide by the TP degree. `shard_plan` gives each rank a contiguous range of KV heads with
all their query heads (ranks may differ by one KV head). With more ranks than KV heads, KV heads are
replicated: each rank holds one KV head and a contiguous share of that head's query group, so a rank's
local heads always form uniform GQA groups and the model's attention path runs unchanged on them. Only
a degree above the number of query heads is refused (a rank would own no head).

Embedding, final norm and LM head stay replicated: on CPU the vocabulary matmul is a small share of a
step (SmolLM2: 49k x 576), sampling happens once on the driver, and a vocab-parallel head would add an
all-gather of logits to every step for no memory that matters at this size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from pdserve.models.config import ModelConfig
from pdserve.models.linear import Linear


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world_size: int
    q_heads: range  # global query-head indices this rank owns
    kv_heads: range  # global KV-head indices (with replication, shared with other ranks)
    intermediate: range  # MLP columns this rank owns

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def even_split(n: int, parts: int, index: int) -> range:
    """The index-th of `parts` contiguous ranges covering range(n); sizes differ by at most one (larger first)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """Raise ValueError with the reason when `config` cannot be split over `world_size` ranks."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if config.num_heads % config.num_kv_heads:
        raise ValueError(f"{config.num_heads} query heads do not group over {config.num_kv_heads} KV heads")
    if world_size > config.num_heads:
        raise ValueError(
            f"tensor_parallel_size {world_size} exceeds the model's {config.num_heads} attention heads: "
            "a rank would own no head"
        )
    if world_size > config.intermediate_size:
        raise ValueError(f"tensor_parallel_size {world_size} exceeds the MLP width {config.intermediate_size}")


def shard_plan(config: ModelConfig, rank: int, world_size: int) -> ShardPlan:
    check_tensor_parallel(config, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    group = config.num_heads // config.num_kv_heads
    intermediate = even_split(config.intermediate_size, world_size, rank)
    if world_size <= config.num_kv_heads:
        kv = even_split(config.num_kv_heads, world_size, rank)
        return ShardPlan(rank, world_size, range(kv.start * group, kv.stop * group), kv, intermediate)
    # more ranks than KV heads: KV head h is replicated on a contiguous run of ranks, which split its
    # query group; world_size <= num_heads keeps every run no longer than the group
    runs = [even_split(world_size, config.num_kv_heads, h) for h in range(config.num_kv_heads)]
    head = next(h for h, run in enumerate(runs) if rank in run)
    share = even_split(group, len(runs[head]), rank - runs[head].start)
    q = range(head * group + share.start, head * group + share.stop)
    return ShardPlan(rank, world_size, q, range(head, head + 1), intermediate)


def shard_config(config: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The rank's view: local head counts (KV pool and workspace shapes follow it); the rest unchanged."""
    return replace(config, num_heads=plan.num_heads, num_kv_heads=plan.num_kv_heads,
                   intermediate_size=len(plan.intermediate))


class AllReduce(nn.Module):
    """A row-parallel linear: this rank's partial product, summed over the group in place."""

    def __init__(self, linear: Linear, group) -> None:
        super().__init__()
        self.linear = linear
        self.group = group
        self.seconds = 0.0  # time spent in the all-reduce (communication plus waiting for peers)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        start = time.perf_counter()
        all_reduce(out, self.group)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


def all_reduce(tensor: torch.Tensor, group) -> None:
    """Sum over `group` in place; a group of None (or size 1) is a no-op, for single-process tests."""
    if group is None or group.size() == 1:
        return
    group.allreduce([tensor]).wait()


def _columns(weight: torch.Tensor, ranges: list[range]) -> torch.Tensor:
    # weight: [in, out] (or a bias [out]) -> the listed column ranges, concatenated, contiguous
    return torch.cat([weight[..., r.start : r.stop] for r in ranges], dim=-1).contiguous()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    linear = Linear(weight.shape[0], weight.shape[1], bias=bias is not None)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def slice_qkv(linear: Linear, config: ModelConfig, plan: ShardPlan) -> Linear:
    d = config.head_dim
    q = range(plan.q_heads.start * d, plan.q_heads.stop * d)
    k = range(config.q_size + plan.kv_heads.start * d, config.q_size + plan.kv_heads.stop * d)
    v = range(k.start + config.kv_size, k.stop + config.kv_size)
    bias = None if linear.bias is None else _columns(linear.bias.data, [q, k, v])
    return _linear(_columns(linear.weight.data, [q, k, v]), bias)


def slice_gate_up(linear: Linear, config: ModelConfig, plan: ShardPlan) -> Linear:
    i, size = plan.intermediate, config.intermediate_size
    ranges = [i, range(size + i.start, size + i.stop)]
    bias = None if linear.bias is None else _columns(linear.bias.data, ranges)
    return _linear(_columns(linear.weight.data, ranges), bias)


def slice_rows(linear: Linear, rows: range, keep_bias: bool) -> Linear:
    # row-parallel: [in, out] -> [len(rows), out]; the bias is added once, on the rank that keeps it
    bias = linear.bias.data.clone() if linear.bias is not None and keep_bias else None
    return _linear(linear.weight.data[rows.start : rows.stop].contiguous(), bias)


@torch.no_grad()
def shard_model(model: nn.Module, rank: int, world_size: int, group) -> ModelConfig:
    """Slice `model` (a loaded LlamaForCausalLM with plain, unpacked `Linear`s) in place for `rank`;
    returns the rank's ModelConfig. Pack the linears afterwards (pdserve.models.linear.pack_linears)."""
    config: ModelConfig = model.config
    plan = shard_plan(config, rank, world_size)
    d = config.head_dim
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(type(m) is Linear for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            raise ValueError("tensor parallelism needs plain (unquantized) linears: use quantization='none'")
        attn.qkv_proj = slice_qkv(attn.qkv_proj, config, plan)
        attn.o_proj = AllReduce(slice_rows(attn.o_proj, range(plan.q_heads.start * d, plan.q_heads.stop * d),
                                           rank == 0), group)
        attn.num_heads, attn.num_kv_heads = plan.num_heads, plan.num_kv_heads
        attn.q_size, attn.kv_size = plan.num_heads * d, plan.num_kv_heads * d
        mlp.gate_up_proj = slice_gate_up(mlp.gate_up_proj, config, plan)
        mlp.down_proj = AllReduce(slice_rows(mlp.down_proj, plan.intermediate, rank == 0), group)
        mlp.intermediate_size = len(plan.intermediate)
    return shard_config(config, plan)


def all_reduce_seconds(model: nn.Module) -> tuple[float, int]:
    """Total seconds and calls spent in the model's all-reduces since it was sharded."""
    modules = [m for m in model.modules() if isinstance(m, AllReduce)]
    return sum(m.seconds for m in modules), sum(m.calls for m in modules)
