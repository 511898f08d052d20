"""The one-call decode path (pdserve.models.fused_decode) against the per-op path on the same quantized
model: the same tokens and logprobs, the steps it does not take, and bad metadata refused before any write."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig
from pdserve.engine.llm import LLM
from pdserve.kernels import cpu_native
from pdserve.models.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from pdserve.models.fused_decode import FusedDecode
from pdserve.models.tiny import TINY_CONFIG, write_tiny_checkpoint
from pdserve.sampling_params import SamplingParams

if cpu_native.library() is None:
    pytest.skip(f"native kernels not built: {cpu_native.unavailable_reason()}", allow_module_level=True)

# every linear's K a multiple of 64, as the native layout needs (TINY_CONFIG's 688 is not)
CONFIG = {**TINY_CONFIG, "intermediate_size": 512}
PROMPTS = [[1, 17, 99, 230, 5, 61], [1, 44, 3], list(range(1, 40))]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("fused-tiny")
    write_tiny_checkpoint(path, CONFIG)
    return str(path)


def _generate(checkpoint: str, quantization: str, fused: bool, monkeypatch, kv_cache_dtype: str = "auto") -> list:
    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(FusedDecode, "supports", staticmethod(lambda *a: False))
        llm = LLM(EngineConfig(model=checkpoint, device="cpu", quantization=quantization,
                               cache=CacheConfig(kv_cache_dtype=kv_cache_dtype)))
        model, caches = llm.engine.runner.model, llm.engine.runner.kv_caches
        assert (model._fused_decode(caches) is not None) == fused
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
        return llm.generate(PROMPTS, params)


@pytest.mark.parametrize("quantization, kv_cache_dtype", [("int4", "auto"), ("int8", "auto"), ("int4", "float16")])
def test_fused_steps_match_the_per_op_path(checkpoint: str, quantization: str, kv_cache_dtype: str,
                                           monkeypatch) -> None:
    if kv_cache_dtype == "float16" and not cpu_native.library().pd_kv_half_supported():
        pytest.skip("built without F16C: float16 caches take torch's path")
    fused = _generate(checkpoint, quantization, True, monkeypatch, kv_cache_dtype)
    per_op = _generate(checkpoint, quantization, False, monkeypatch, kv_cache_dtype)
    for a, b in zip(fused, per_op):
        assert a.token_ids == b.token_ids
        # silu's expf against torch's vectorized exp moves x by ulps, and the VNNI kernel's int8 planes of x
        # round on such moves (2^-15 of a block's max): 6e-4 seen; a wrong slot, head or position moves
        # logprobs by tenths and the tokens with them
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 3e-3


def test_unquantized_models_and_torch_kernels_keep_the_per_op_path(checkpoint: str, monkeypatch) -> None:
    llm = LLM(model=checkpoint, device="cpu")
    assert llm.engine.runner.model._fused_decode(llm.engine.runner.kv_caches) is None
    monkeypatch.setenv(cpu_native.KERNEL_ENV, "torch")
    llm = LLM(model=checkpoint, device="cpu", quantization="int8")
    assert llm.engine.runner.model._fused_decode(llm.engine.runner.kv_caches) is None


def _meta(slots: list[int], tables: list[list[int]], lens: list[int], prefills=()) -> AttentionMetadata:
    group = DecodeGroup(0, torch.tensor(tables), torch.tensor(lens), max(lens))
    return AttentionMetadata(slot_mapping=torch.tensor(slots), num_decode_tokens=len(lens),
                             decode_groups=(group,), prefills=prefills)


def test_steps_it_does_not_take_and_bad_metadata(checkpoint: str) -> None:
    llm = LLM(model=checkpoint, device="cpu", quantization="int4")
    runner = llm.engine.runner
    fused = runner.model._fused_decode(runner.kv_caches)
    x = torch.randn(1, CONFIG["hidden_size"])
    with torch.inference_mode():
        assert fused.takes(x, _meta([3], [[0]], [4]))
        chunk = PrefillChunk(1, 2, 2, torch.tensor([1]))
        mixed = _meta([3, 16, 17], [[0]], [4], (chunk,))
        assert not fused.takes(torch.randn(3, CONFIG["hidden_size"]), mixed)
        wide = _meta(list(range(40)), [[0, 1, 2]] * 40, [41] * 40)
        assert not fused.takes(torch.randn(40, CONFIG["hidden_size"]), wide)  # above MAX_KERNEL_ROWS
        assert not fused.takes(x.double(), _meta([3], [[0]], [4]))
        before = runner.kv_pool.clone()
        blocks, block_size = runner.num_blocks, runner.block_size
        for slots, tables, lens, positions in (([blocks * block_size], [[0]], [4], [3]),  # slot outside
                                               ([3], [[blocks]], [4], [3]),  # block id outside
                                               ([3], [[0]], [block_size + 1], [3]),  # context past its table
                                               ([3], [[0]], [4], [10**6])):  # position past the rotary table
            with pytest.raises(IndexError, match="decode step"):
                fused(x.clone(), torch.tensor(positions), _meta(slots, tables, lens))
        assert torch.equal(runner.kv_pool, before)


def test_several_decode_groups_run_as_one_table(checkpoint: str) -> None:
    llm = LLM(model=checkpoint, device="cpu", quantization="int8")
    runner = llm.engine.runner
    fused = runner.model._fused_decode(runner.kv_caches)
    assert runner.block_size == 16
    gen = torch.Generator().manual_seed(0)
    runner.kv_pool.copy_(torch.randn(runner.kv_pool.shape, generator=gen))
    start = runner.kv_pool.clone()
    x = torch.randn(3, CONFIG["hidden_size"], generator=gen)
    # three sequences at positions 40, 3 and 4 (block size 16): blocks [0, 1, 2], [5] and [6]
    positions, slots = torch.tensor([40, 3, 4]), torch.tensor([2 * 16 + 8, 5 * 16 + 3, 6 * 16 + 4])
    groups = (DecodeGroup(0, torch.tensor([[0, 1, 2]]), torch.tensor([41]), 41),
              DecodeGroup(1, torch.tensor([[5], [6]]), torch.tensor([4, 5]), 5))
    two = AttentionMetadata(slot_mapping=slots, num_decode_tokens=3, decode_groups=groups, prefills=())
    one = _meta(slots.tolist(), [[0, 1, 2], [5, 0, 0], [6, 0, 0]], [41, 4, 5])
    with torch.inference_mode():
        out_two = fused(x.clone(), positions, two)
        after_two = runner.kv_pool.clone()
        runner.kv_pool.copy_(start)
        out_one = fused(x.clone(), positions, one)
    assert torch.equal(out_two, out_one) and torch.equal(after_two, runner.kv_pool)
    assert not torch.equal(after_two, start)
