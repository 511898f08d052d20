"""KV cache quantization: error bounds, the block layout (scales inside), layout hashes and block accounting."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLM, AsyncLLMEngine, GenerationRequest, LLMEngine
from pdserve.kernels.kv_quant import QuantizedCache, dequantize, quantize
from pdserve.engine.handoff import KVExporter, KVImporter, engine_layout, engine_pool
from pdserve.kvcache.layout import layout_of
from pdserve.kvcache.pool import KVPoolIO
from pdserve.kvcache.quant import allocate_kv_cache, kv_block_nbytes, kv_bytes_per_token
from pdserve.kvcache.transports.local import LocalHub, LocalTransport
from pdserve.models.config import ModelConfig, model_config_from_hf
from pdserve.models.tiny import TINY_CONFIG, ensure_tiny_checkpoint
from pdserve.sampling_params import SamplingParams

QUANT = ["int8", "fp8_e4m3"]
STORED = ["float16", *QUANT]  # the dtypes whose stored values differ from a float32 model's


def _model_config(**kw) -> ModelConfig:
    base = dict(num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16)
    return dataclasses.replace(model_config_from_hf(TINY_CONFIG), **{**base, **kw})


@pytest.mark.parametrize("kv_cache_dtype", QUANT)
@pytest.mark.parametrize("scale", [1e-3, 1.0, 80.0])
def test_round_trip_error_is_within_half_a_step(kv_cache_dtype, scale):
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(0)) * scale
    x[3, 1] = 0.0  # an all-zero row stays zero
    q, s = quantize(x, kv_cache_dtype)
    assert s.dtype == torch.float16 and s.shape == x.shape[:-1]
    y = dequantize(q, s)
    amax = x.abs().amax(-1, keepdim=True)
    if kv_cache_dtype == "int8":
        assert q.dtype == torch.int8
        # round to nearest: |error| <= s / 2 per element, s = amax / 127 up to fp16 rounding of s
        bound = 0.5 * s.float()[..., None] * (1 + 1e-6)
        assert ((q.float() - x / s.float()[..., None]).abs() <= 0.5 + 1e-4).all()
    else:
        assert q.dtype == torch.float8_e4m3fn
        # 3 mantissa bits: relative error <= 2^-4 of the value, plus the subnormal step near zero
        bound = x.abs() * 2**-4 + s.float()[..., None] * 2**-9
    assert ((y - x).abs() <= bound + 1e-12).all()
    assert (y[3, 1] == 0).all()
    assert (q.float().abs().amax(-1) <= (127 if kv_cache_dtype == "int8" else 448)).all()
    assert (s.float() >= amax[..., 0] / (127 if kv_cache_dtype == "int8" else 448)).all()  # nothing clipped


def test_int8_relative_error_of_gaussian_rows_is_small():
    x = torch.randn(4096, 64, generator=torch.Generator().manual_seed(1))
    q, s = quantize(x, "int8")
    rel = (dequantize(q, s) - x).norm() / x.norm()
    assert rel < 0.012  # ~amax / 127 / sqrt(12) per element over unit-variance rows


@pytest.mark.parametrize("kv_cache_dtype", QUANT)
def test_pool_blocks_are_contiguous_and_hold_values_then_scales(kv_cache_dtype):
    config = _model_config()
    pool, caches = allocate_kv_cache(config, 8, 5, torch.float32, kv_cache_dtype, "cpu")
    nbytes = kv_block_nbytes(config, 8, torch.float32, kv_cache_dtype)
    assert pool.shape == (5, nbytes) and pool.is_contiguous() and KVPoolIO(pool).block_nbytes == nbytes
    rows = 3 * 2 * 8 * 2  # layers, K/V, tokens, heads
    assert nbytes == rows * 16 + rows * 2
    k_cache, v_cache = caches[1]
    x = torch.randn(2, 16)
    q, s = quantize(x, kv_cache_dtype)
    k_cache.data.view(torch.uint8)[3, 5] = q.view(torch.uint8)
    v_cache.scale[3, 5] = s
    block = pool[3]
    values = block[: rows * 16].view(torch.uint8).view(3, 2, 8, 2, 16)
    scales = block[rows * 16 :].view(torch.float16).view(3, 2, 8, 2)
    assert torch.equal(values[1, 0, 5], q.view(torch.uint8))
    assert torch.equal(scales[1, 1, 5], s)
    assert pool[[0, 1, 2, 4]].count_nonzero() == 0


def test_int8_bytes_per_token_is_about_half_of_bf16():
    config = _model_config(head_dim=64, num_kv_heads=3, num_layers=30)
    int8 = kv_bytes_per_token(config, torch.bfloat16, "int8")
    bf16 = kv_bytes_per_token(config, torch.bfloat16)
    assert int8 / bf16 == pytest.approx(66 / 128)
    assert layout_of(config, torch.bfloat16, 16, "int8").block_nbytes == 16 * int8
    assert layout_of(config, torch.bfloat16, 16).block_nbytes == 16 * bf16


def test_layout_hash_covers_value_dtype_and_scale_layout():
    config = _model_config()
    hashes = {
        layout_of(config, dtype, 16, kv).layout_hash
        for dtype in (torch.float32, torch.bfloat16) for kv in ("auto", "float16", "int8", "fp8_e4m3")
    }
    assert len(hashes) == 5  # float16, int8 and fp8 do not depend on the model dtype: the stored bytes are the same
    half = layout_of(config, torch.float32, 16, "float16")
    assert half.dtype == "float16" and half.scale_layout == "none"
    assert half.block_nbytes * 2 == layout_of(config, torch.float32, 16).block_nbytes
    int8 = layout_of(config, torch.float32, 16, "int8")
    assert int8.dtype == "int8" and int8.scale_layout == "token_head:float16"
    other_scales = type(int8)(**{**int8.__dict__, "scale_layout": "block_head:float32"})
    assert other_scales.layout_hash != int8.layout_hash


def test_cache_config_refuses_unknown_kv_dtype():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int4")


# --- engines ----------------------------------------------------------------------------------------

NUM_BLOCKS = 32
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = tuple(range(40, 77))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def _engine(tiny_dir, kv_cache_dtype: str, dtype: str = "float32", **cache) -> LLMEngine:
    cache = {"num_blocks": NUM_BLOCKS, **cache}
    return LLMEngine(EngineConfig(model=str(tiny_dir), device="cpu", dtype=dtype,
                                  cache=CacheConfig(kv_cache_dtype=kv_cache_dtype, **cache)))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", *STORED])
def test_block_accounting_from_the_memory_budget_is_exact(tiny_dir, kv_cache_dtype):
    budget = 10 * kv_block_nbytes(_engine(tiny_dir, "auto").model_config, 16, torch.float32, kv_cache_dtype) + 7
    engine = _engine(tiny_dir, kv_cache_dtype, num_blocks=None, memory_budget_bytes=budget)
    block_nbytes = engine_layout(AsyncLLMEngine(engine)).block_nbytes
    assert engine.block_manager.num_blocks == 10 == engine.runner.kv_pool.shape[0]
    assert engine.runner.kv_pool.numel() * engine.runner.kv_pool.element_size() == 10 * block_nbytes
    assert KVPoolIO(engine.runner.kv_pool).block_nbytes == block_nbytes
    assert isinstance(engine.runner.kv_caches[0][0], QuantizedCache) == (kv_cache_dtype in QUANT)


@pytest.mark.parametrize("kv_cache_dtype, tolerance", [("int8", 0.05), ("float16", 0.005)])
def test_stored_kv_engine_stays_close_to_float32(tiny_dir, kv_cache_dtype, tolerance):
    # teacher-forced prompt logprobs through the paged path (chunks of 16 read the int8 cache back)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    scheduler = {"max_num_batched_tokens": 16, "max_num_seqs": 4}
    results = {}
    for kv in ("auto", kv_cache_dtype):
        llm = LLM(EngineConfig(model=str(tiny_dir), device="cpu", dtype="float32",
                               cache=CacheConfig(num_blocks=NUM_BLOCKS, kv_cache_dtype=kv),
                               scheduler=SchedulerConfig(**scheduler)))
        (out,) = llm.generate([list(PROMPT)], params)
        results[kv] = torch.tensor(out.prompt_logprobs[1:])
    assert (results["auto"] - results[kv_cache_dtype]).abs().max() < tolerance
    assert not torch.equal(results["auto"], results[kv_cache_dtype])  # the stored dtype really is in the path


def test_float16_cache_under_a_bfloat16_model(tiny_dir):
    """The serving default on CPU whatever the activation dtype: a bf16 model's K/V cast on store and gather."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    results = {}
    for kv in ("auto", "float16"):
        llm = LLM(EngineConfig(model=str(tiny_dir), device="cpu", dtype="bfloat16",
                               cache=CacheConfig(num_blocks=NUM_BLOCKS, kv_cache_dtype=kv),
                               scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)))
        assert llm.engine.runner.kv_pool.dtype is (torch.bfloat16 if kv == "auto" else torch.float16)
        (out,) = llm.generate([list(PROMPT)], params)
        results[kv] = torch.tensor(out.prompt_logprobs[1:])
    assert (results["auto"] - results["float16"]).abs().max() < 0.1


def test_int8_and_bf16_pools_refuse_each_other_with_a_counted_fallback(tiny_dir):
    async def main():
        a = AsyncLLMEngine(_engine(tiny_dir, "int8"))
        b = AsyncLLMEngine(_engine(tiny_dir, "auto", dtype="bfloat16"))
        hub = LocalHub()
        exporter = KVExporter(a, LocalTransport(engine_pool(a), engine_layout(a), a.release_lease_quietly, hub=hub))
        importer = KVImporter(b, LocalTransport(engine_pool(b), engine_layout(b), hub=hub))
        deltas = [d async for d in a.generate(GenerationRequest("p", PROMPT, GREEDY, prefill_only=True))]
        params = await exporter.export(deltas[0].kv_handoff)
        result = await importer.import_kv(params)
        assert not result.ok and result.fallback_reason == "layout_mismatch"
        assert importer.fallbacks == {"layout_mismatch": 1}
        assert b.engine.block_manager.num_free_blocks == NUM_BLOCKS
        await a.release_lease(deltas[0].kv_handoff.lease_id)
        for e in (a, b):
            await e.close()

    asyncio.run(main())


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "float16"])
def test_stored_kv_handoff_between_engines_matches_plain_generation(tiny_dir, kv_cache_dtype):
    async def main():
        a, b, ref = (AsyncLLMEngine(_engine(tiny_dir, kv_cache_dtype)) for _ in range(3))
        hub = LocalHub()
        exporter = KVExporter(a, LocalTransport(engine_pool(a), engine_layout(a), a.release_lease_quietly, hub=hub))
        importer = KVImporter(b, LocalTransport(engine_pool(b), engine_layout(b), hub=hub))
        expected = [t async for d in ref.generate(GenerationRequest("r", PROMPT, GREEDY)) for t in d.token_ids]
        deltas = [d async for d in a.generate(GenerationRequest("p", PROMPT, GREEDY, prefill_only=True))]
        result = await importer.import_kv(await exporter.export(deltas[0].kv_handoff))
        assert result.ok
        first = deltas[0].token_ids[0]
        request = GenerationRequest("d", PROMPT, GREEDY, adopt_lease_id=result.lease_id, first_token_id=first)
        rest = [t async for d in b.generate(request) for t in d.token_ids]
        assert [first, *rest] == expected
        for e in (a, b, ref):
            await e.close()

    asyncio.run(main())


@pytest.mark.parametrize("kv_cache_dtype", STORED)
def test_prefix_cache_hits_and_preemption_read_the_same_quantized_blocks(tiny_dir, kv_cache_dtype):
    llm = LLM(EngineConfig(model=str(tiny_dir), device="cpu", dtype="float32",
                           cache=CacheConfig(num_blocks=NUM_BLOCKS, kv_cache_dtype=kv_cache_dtype)))
    (first,) = llm.generate([list(PROMPT)], GREEDY)
    (again,) = llm.generate([list(PROMPT)], GREEDY)
    assert again.num_cached_tokens >= 32 and again.token_ids == first.token_ids
    # a pool too small for all four at once preempts (recompute) and must still give the same tokens
    small = LLM(EngineConfig(model=str(tiny_dir), device="cpu", dtype="float32",
                             cache=CacheConfig(num_blocks=8, kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)))
    (expected,) = llm.generate([list(PROMPT[:32])], GREEDY)
    outs = small.generate([list(PROMPT[:32])] * 4, GREEDY)  # 4 x 2 blocks admitted, each grows to a third
    assert all(o.token_ids == expected.token_ids for o in outs)
    assert small.engine.num_preemptions > 0
