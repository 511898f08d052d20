"""Tensor parallelism in `pdserve plan`: a replica of n ranks (n devices) from the TP=1 latency model and an
all-reduce cost.

Step time, a transform of the TP=1 fit (a profile or the roofline alike):

    t_n(step) = t_1(step) / n + 2 · layers · (α + 2(n-1)/n · tokens · hidden · B / β)

Every term of the TP=1 model (weight pass, per-token compute, attention over the KV) is split n ways: each
rank reads 1/n of the linears and computes 1/n of the heads and of the MLP. Each layer adds two all-reduces
of the step's hidden states (after o_proj and after down_proj: pdserve.models.tensor_parallel), `tokens`
rows of `hidden` values of B bytes (the activation dtype); a ring all-reduce of S bytes over n ranks costs
α + 2(n-1)/n · S / β, with α the per-call latency and β the bus bandwidth (nccl-tests' `busbw`). Both come
from a measurement of the interconnect (docs/tensor_parallel.md gives this VM's gloo figures and how to
measure NCCL). The model is the ideal split plus communication: the fit's per-step overhead, the replicated
embedding and LM head, and uneven head splits (SmolLM2's 9 query heads over 2 ranks: 6 and 3) do not
shrink with n, so real steps are slower than it says, on CPU much slower.

Memory, per device (`--memory`): the linears are split over the n devices; the embedding, the norms and, on
the driver rank, the LM head are held whole by each. Every rank's KV pool has the driver's block count, each
block holding that rank's KV heads: ceil(kv_heads / n), or 1 where n > kv_heads (a KV head is then
replicated on the ranks that share it). The plan sizes the fullest device: the driver, with the most heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pdserve.latency_model import DecodeModel, LatencyModel, PrefillModel
from pdserve.models.config import ModelConfig

ALL_REDUCES_PER_LAYER = 2  # after the attention's o_proj and the MLP's down_proj


@dataclass(frozen=True)
class AllReduceCost:
    latency_s: float  # α: one all-reduce call, however small
    bandwidth_bytes_s: float  # β: bus bandwidth (nccl-tests busbw), so a call moves 2(n-1)/n · S / β

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_bytes_s <= 0:
            raise ValueError("all-reduce latency must be >= 0 and its bandwidth > 0")

    def time_s(self, nbytes: int, world_size: int) -> float:
        if world_size == 1:
            return 0.0
        return self.latency_s + 2 * (world_size - 1) / world_size * nbytes / self.bandwidth_bytes_s


def tensor_parallel_model(model: LatencyModel, config: ModelConfig, world_size: int, activation_bytes: int,
                          allreduce: AllReduceCost) -> LatencyModel:
    """The TP=`world_size` replica's latency model from the TP=1 one (the module's formula), still linear in
    the same features: the all-reduce latency joins the constant term, its bytes the per-token term."""
    if world_size == 1:
        return model
    n, calls = world_size, ALL_REDUCES_PER_LAYER * config.num_layers
    per_call = allreduce.time_s(0, n)
    per_token = calls * (allreduce.time_s(config.hidden_size * activation_bytes, n) - per_call)
    p, d = model.prefill, model.decode
    return replace(
        model,
        prefill=PrefillModel(a=p.a / n + calls * per_call, b=p.b / n + per_token, c=p.c / n, d=p.d / n),
        decode=DecodeModel(a=d.a / n + calls * per_call, b=d.b / n + per_token, c=d.c / n),
    )


def local_kv_heads(config: ModelConfig, world_size: int) -> int:
    """KV heads in the fullest rank's pool, which sets every rank's block size."""
    return math.ceil(config.num_kv_heads / world_size) if world_size <= config.num_kv_heads else 1


def rank_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The model as the fullest rank's KV pool sees it (its KV heads), for KV bytes per token per device."""
    return replace(config, num_kv_heads=local_kv_heads(config, world_size))


def replicated_config(config: ModelConfig) -> ModelConfig:
    """What the driver rank holds whole besides the layers' norms: the model without its decoder layers
    (embedding, LM head, final norm)."""
    return replace(config, num_layers=0)
