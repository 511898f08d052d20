"""Tensor-parallel sharding (pdserve.models.tensor_parallel): the head plan, the weight slices, and the
sharded tiny model's logits against the unsharded one, its ranks as threads over a real gloo group."""

from __future__ import annotations

import copy
import datetime
import threading
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from pdserve.config import EngineConfig
from pdserve.kvcache.quant import allocate_kv_cache
from pdserve.models.attention import AttentionMetadata, PrefillChunk
from pdserve.models.config import load_model_config
from pdserve.models.loader import load_model
from pdserve.models.resolve import resolve_model_path
from pdserve.models.tensor_parallel import (
    AllReduce, check_tensor_parallel, shard_model, shard_plan, slice_gate_up, slice_qkv, slice_rows,
)

TINY = load_model_config(resolve_model_path("tiny"))  # 8 heads over 4 KV heads


def _config(num_heads: int, num_kv_heads: int, intermediate: int = 96):
    return replace(TINY, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=8,
                   hidden_size=num_heads * 8, intermediate_size=intermediate)


@pytest.mark.parametrize("heads", [(8, 4), (9, 3), (9, 9), (32, 8), (4, 1), (14, 2)])
def test_every_rank_owns_whole_gqa_groups_and_the_heads_are_covered_once(heads):
    num_heads, num_kv_heads = heads
    config = _config(num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    for world in range(1, num_heads + 1):
        owned, columns = [], []
        for rank in range(world):
            plan = shard_plan(config, rank, world)
            assert plan.num_heads >= 1 and plan.num_heads % plan.num_kv_heads == 0
            local_group = plan.num_heads // plan.num_kv_heads
            # local query head j attends local KV head j // local_group: the same KV head as globally
            for j, head in enumerate(plan.q_heads):
                assert plan.kv_heads[j // local_group] == head // group
            owned += list(plan.q_heads)
            columns += list(plan.intermediate)
        assert owned == list(range(num_heads)), f"world {world}"
        assert columns == list(range(config.intermediate_size))


def test_smollm2_shapes_split_unevenly_and_replicate_kv_heads_past_three_ranks():
    config = _config(9, 3, intermediate=1536)
    tp2 = [shard_plan(config, r, 2) for r in range(2)]
    assert [(p.q_heads, p.kv_heads) for p in tp2] == [(range(6), range(2)), (range(6, 9), range(2, 3))]
    tp4 = [shard_plan(config, r, 4) for r in range(4)]
    assert [p.kv_heads for p in tp4] == [range(1), range(1), range(1, 2), range(2, 3)]
    assert [p.q_heads for p in tp4] == [range(2), range(2, 3), range(3, 6), range(6, 9)]
    assert [len(p.intermediate) for p in tp4] == [384] * 4


def test_degrees_past_the_head_count_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="exceeds the model's 9 attention heads"):
        check_tensor_parallel(_config(9, 3), 10)
    with pytest.raises(ValueError, match=">= 1"):
        EngineConfig(device="cpu", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="unquantized weights on CPU"):
        EngineConfig(device="cpu", tensor_parallel_size=2, quantization="int8")
    from pdserve.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="exceeds the model's 8 attention heads"):
        LLMEngine(EngineConfig(device="cpu", tensor_parallel_size=16))


def _model():
    model, _ = load_model(resolve_model_path("tiny"), torch.float32, "cpu")
    return model


def test_column_and_row_slices_sum_back_to_the_full_projections():
    torch.manual_seed(0)
    layer = _model().layers[1]
    x = torch.randn(5, TINY.hidden_size)
    world = 4
    plans = [shard_plan(TINY, r, world) for r in range(world)]
    # MLP: column-parallel gate_up, row-parallel down, summed over ranks == the full MLP
    full = layer.mlp(x)
    partial = torch.zeros_like(full)
    for plan in plans:
        gate, up = slice_gate_up(layer.mlp.gate_up_proj, TINY, plan)(x).chunk(2, dim=-1)
        partial += slice_rows(layer.mlp.down_proj, plan.intermediate, plan.rank == 0)(torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(partial, full, atol=1e-5, rtol=1e-5)
    # qkv: each rank's q, k, v are the full projection's columns of its heads
    q, k, v = layer.self_attn.qkv_proj(x).split([TINY.q_size, TINY.kv_size, TINY.kv_size], dim=-1)
    d = TINY.head_dim
    for plan in plans:
        lq, lk, lv = slice_qkv(layer.self_attn.qkv_proj, TINY, plan)(x).split(
            [plan.num_heads * d, plan.num_kv_heads * d, plan.num_kv_heads * d], dim=-1)
        torch.testing.assert_close(lq, q[:, plan.q_heads.start * d : plan.q_heads.stop * d])
        torch.testing.assert_close(lk, k[:, plan.kv_heads.start * d : plan.kv_heads.stop * d])
        torch.testing.assert_close(lv, v[:, plan.kv_heads.start * d : plan.kv_heads.stop * d])


def prefill_logits(model: torch.nn.Module, config, token_ids: torch.Tensor, block_size: int = 16) -> torch.Tensor:
    """Logits [T, V] of one prompt prefilled from an empty cache, at every position."""
    num_tokens = token_ids.numel()
    num_blocks = -(-num_tokens // block_size)
    _, kv_caches = allocate_kv_cache(config, block_size, num_blocks, torch.float32, "auto", torch.device("cpu"))
    table = torch.arange(num_blocks)
    meta = AttentionMetadata(torch.arange(num_tokens), 0, (), (PrefillChunk(0, num_tokens, num_tokens, table),))
    with torch.inference_mode():
        hidden = model(token_ids, torch.arange(num_tokens), kv_caches, meta)
        return model.compute_logits(hidden)


def sharded_logits(model: torch.nn.Module, world: int, token_ids: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's logits, the ranks as threads of this process over one real gloo group."""
    store = dist.HashStore()
    results: list = [None] * world

    def rank_main(rank: int) -> None:
        try:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = datetime.timedelta(seconds=60)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            group = dist.ProcessGroupGloo(store, rank, world, options)
            shard = copy.deepcopy(model)
            local = shard_model(shard, rank, world, group)
            results[rank] = prefill_logits(shard, local, token_ids)
        except Exception as e:  # noqa: BLE001 - re-raised by the caller
            results[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_tiny_model_matches_the_unsharded_logits_at_every_position(world):
    model = _model()
    token_ids = torch.randint(0, TINY.vocab_size, (40,), generator=torch.Generator().manual_seed(world))
    expected = prefill_logits(model, TINY, token_ids)
    ranks = sharded_logits(model, world, token_ids)
    for logits in ranks:
        assert (logits - expected).abs().max().item() < 1e-4
    assert not any(isinstance(m, AllReduce) for m in model.modules())  # ranks sharded copies
    # without the all-reduces the shards disagree: the parity above depends on them
    shard = copy.deepcopy(model)
    local = shard_model(shard, 0, world, group=None)
    assert (prefill_logits(shard, local, token_ids) - expected).abs().max().item() > 1e-2
