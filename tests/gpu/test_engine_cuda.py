"""The engine on CUDA against HF transformers on CUDA: a random Llama (GQA) and Qwen2 (qkv bias, tied
embeddings) in fp32, greedy tokens identical over 32 steps, alone and batched with chunked prefill (the
Triton attention backend, CUDA's default); bf16 runs and agrees with fp32 on most tokens.

Run in a pytest session of its own (`pytest -m gpu tests/gpu`), like test_kernels_cuda.py.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
transformers = pytest.importorskip("transformers")

NUM_NEW = 32


def _prompts(n: int, seed: int, low: int = 3, high: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(low, high))] for _ in range(n)]


def _peaky(model: torch.nn.Module, seed: int) -> None:
    # larger-than-default weights: well-separated logits, so greedy ties cannot flip on rounding
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:
                fan_in = param.shape[-1] if "embed" not in name else 1
                gain = 4.0 if "lm_head" in name else 1.0
                param.copy_(gain * torch.randn(param.shape, generator=gen) / fan_in**0.5)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    from pdserve.models.tiny import ensure_tiny_checkpoint

    tiny_dir = ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    if request.param == "llama":
        config = transformers.LlamaConfig(
            vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rope_theta=500000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=False)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(
            vocab_size=384, hidden_size=256, intermediate_size=448, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
            tie_word_embeddings=True, use_sliding_window=False)
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    _peaky(model, 0)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, path / name)
    return path, model.to("cuda")


@torch.no_grad()
def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = []
    for _ in range(NUM_NEW):
        token = int(model(ids).logits[0, -1].argmax())
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]], device="cuda")], dim=1)
    return out


def _llm(path, dtype: str, **scheduler):
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import LLM

    return LLM(EngineConfig(
        model=str(path), device="cuda", dtype=dtype, cache=CacheConfig(block_size=16, num_blocks=512),
        scheduler=SchedulerConfig(**{"max_num_seqs": 16, "max_num_batched_tokens": 512, **scheduler})))


def _greedy():
    from pdserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def test_greedy_alone_matches_hf_fp32(checkpoint):
    path, hf_model = checkpoint
    llm = _llm(path, "float32")
    for prompt in _prompts(3, 1):
        assert llm.generate([prompt], _greedy())[0].token_ids == _hf_greedy(hf_model, prompt)


def test_greedy_batched_chunked_matches_hf_fp32(checkpoint):
    path, hf_model = checkpoint
    prompts = _prompts(8, 2, 1, 300)
    llm = _llm(path, "float32", enable_chunked_prefill=True, max_num_batched_tokens=64)
    outputs = llm.generate(prompts, _greedy())
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == _hf_greedy(hf_model, prompt)
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bf16_runs_and_mostly_agrees_with_fp32(checkpoint):
    path, _ = checkpoint
    prompts = _prompts(8, 3)
    fp32 = [o.token_ids for o in _llm(path, "float32").generate(prompts, _greedy())]
    bf16 = [o.token_ids for o in _llm(path, "bfloat16").generate(prompts, _greedy())]
    first_steps = [a[0] == b[0] for a, b in zip(fp32, bf16)]
    print({"bf16_first_token_agreement": sum(first_steps) / len(first_steps)})
    assert sum(first_steps) >= 6, (fp32, bf16)
