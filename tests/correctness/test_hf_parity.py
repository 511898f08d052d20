"""pdserve against Hugging Face transformers: prefill logits and greedy tokens, token for token."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import LLM
from pdserve.models.attention import AttentionMetadata, PrefillChunk
from pdserve.models.loader import load_model
from pdserve.sampling_params import SamplingParams

NUM_NEW = 32
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def _prompts(n: int, seed: int, low: int = 3, high: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(low, high))] for _ in range(n)]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_new: int = NUM_NEW) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    for _ in range(num_new):
        token = int(model(ids).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def _llm(path, **scheduler) -> LLM:
    return LLM(EngineConfig(
        model=str(path), device="cpu", dtype="float32",
        cache=CacheConfig(block_size=16, num_blocks=256),
        scheduler=SchedulerConfig(**{"max_num_seqs": 16, "max_num_batched_tokens": 512, **scheduler}),
    ))


@pytest.fixture(params=["llama", "qwen2"])
def checkpoint(request, hf_checkpoints):
    return hf_checkpoints[request.param]


def test_prefill_logits_match(checkpoint):
    path, hf_model = checkpoint
    model, config = load_model(path, torch.float32, "cpu")
    block_size, prompt = 16, _prompts(1, 0, 70, 70)[0]
    num_blocks = (len(prompt) + block_size - 1) // block_size
    k = torch.zeros(num_blocks, block_size, config.num_kv_heads, config.head_dim)
    caches = [(k.clone(), k.clone()) for _ in range(config.num_layers)]
    table = torch.arange(num_blocks)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(len(prompt)), num_decode_tokens=0, decode_groups=(),
        prefills=(PrefillChunk(0, len(prompt), len(prompt), table),),
    )
    with torch.no_grad():
        ours = model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)), caches, meta))
        theirs = hf_model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert ours.std() > 2.0  # non-degenerate logits, so the greedy checks below mean something


def test_greedy_alone(checkpoint):
    path, hf_model = checkpoint
    llm = _llm(path)
    for prompt in _prompts(2, 1):
        assert llm.generate([prompt], GREEDY)[0].token_ids == hf_greedy(hf_model, prompt)


@pytest.mark.parametrize("chunked", [True, False])
def test_greedy_batched_mixed_lengths(checkpoint, chunked):
    path, hf_model = checkpoint
    prompts = _prompts(6, 2, 1, 120)
    # A small budget forces prefill chunks to share steps with running decodes.
    llm = _llm(path, enable_chunked_prefill=chunked, max_num_batched_tokens=40 if chunked else 512)
    outputs = llm.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy(hf_model, prompt)


def test_greedy_prefix_cache_hits(checkpoint):
    path, hf_model = checkpoint
    shared = _prompts(1, 3, 50, 50)[0]
    prompts = [shared + tail for tail in _prompts(3, 4, 1, 20)] + [shared[:32]]
    llm = _llm(path)
    llm.generate([shared], SamplingParams(max_tokens=1, temperature=0.0))  # warm the prefix cache
    outputs = llm.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens >= 32 for o in outputs[:3])
    assert outputs[3].num_cached_tokens == 16  # the last token of a prompt is always recomputed
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == hf_greedy(hf_model, prompt)
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
