"""The engine serving weight-only quantized linears on CUDA (CudaQuantLinear: Triton int4/int8, FP8 via
_scaled_mm) against the same engine on CPU: a random Llama (GQA), rounded to nearest at load, greedy over
16 steps. CUDA runs bf16 activations, the CPU reference float32 over the same quantization, so tokens
are compared as in test_engine_cuda.py's bf16 test: the first token of most prompts must agree (the
logits are made well separated), and the agreement of the whole sequences is printed.

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

NUM_NEW = 16
NUM_PROMPTS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # as test_engine_cuda.py's llama checkpoint: larger-than-default weights, well-separated logits
    import triton

    if triton.knobs.runtime.interpret:
        pytest.skip("TRITON_INTERPRET is on in this session: run tests/gpu in a pytest session of its own")
    from pdserve.models.tiny import ensure_tiny_checkpoint

    tiny_dir = ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))
    config = transformers.LlamaConfig(
        vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                fan_in = param.shape[-1] if "embed" not in name else 1
                gain = 4.0 if "lm_head" in name else 1.0
                param.copy_(gain * torch.randn(param.shape, generator=gen) / fan_in**0.5)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_dir / name, path / name)
    return path


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(3, 120))] for _ in range(NUM_PROMPTS)]


def _generate(path, device: str, dtype: str, quantization: str) -> tuple[list[list[int]], object]:
    from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine import LLM
    from pdserve.sampling_params import SamplingParams

    llm = LLM(EngineConfig(
        model=str(path), device=device, dtype=dtype, quantization=quantization,
        cache=CacheConfig(block_size=16, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024)))
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(_prompts(), params)], llm


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    def prefix(x: list[int], y: list[int]) -> int:
        return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))

    return {
        "first_token": sum(x[0] == y[0] for x, y in zip(a, b)) / len(a),
        "tokens": sum(p == q for x, y in zip(a, b) for p, q in zip(x, y)) / sum(map(len, a)),
        "mean_common_prefix": sum(prefix(x, y) for x, y in zip(a, b)) / len(a),
    }


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_engine_on_cuda_agrees_with_cpu(checkpoint, quantization):
    from pdserve.kernels.fp8_matmul import device_has_fp8
    from pdserve.models.quant_linear_cuda import CudaQuantLinear

    if quantization == "fp8" and not device_has_fp8("cuda"):
        pytest.skip("no FP8 tensor cores on this GPU")
    cuda, llm = _generate(checkpoint, "cuda", "bfloat16", quantization)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, CudaQuantLinear)]
    assert quantization in {m.kernel for m in linears}, llm.engine.served_weights  # int4: LM head int8
    # fp8 has no CPU path: its reference is the unquantized float32 engine
    cpu, _ = _generate(checkpoint, "cpu", "float32", "none" if quantization == "fp8" else quantization)
    assert all(len(t) == NUM_NEW for t in cuda)
    agreement = _agreement(cuda, cpu)
    print({f"{quantization}_cuda_bf16_vs_cpu_fp32": agreement, "served": llm.engine.served_weights})
    assert agreement["first_token"] >= 6 / NUM_PROMPTS, (cuda, cpu)
