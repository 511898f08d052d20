"""Frozen engine configuration. Derived values are properties, never written back."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.structured.config import StructuredConfig

KV_CACHE_DTYPES = ("auto", "float16", "int8", "fp8_e4m3")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "fp8")  # pdserve.models.quantization.QUANTIZATIONS
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    return "bfloat16" if device.startswith("cuda") else "float32"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV pool size: an explicit block count wins over the byte budget.
    num_blocks: int | None = None
    memory_budget_bytes: int = 512 * 1024 * 1024
    enable_prefix_caching: bool = True
    # "auto" (the model dtype) | "float16" (CPU: half a float32 model's KV bytes) | "int8" | "fp8_e4m3": the
    # pool stores quantized K/V with per-(token, KV head) scales inside each block; attention upcasts
    # (pdserve.kvcache.quant)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # Per-step token budget shared by decodes (1 token each) and prefill chunks.
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Draft up to `num_speculative_tokens` tokens per decode step and verify them in one forward pass."""

    method: str = "ngram"
    num_speculative_tokens: int = 8
    # ngram: match the last n tokens (n from max down to min) against earlier prompt + output text
    prompt_lookup_min: int = 3
    prompt_lookup_max: int = 4
    # no drafts in steps with more running sequences than this (verification rows stop being nearly
    # free once the batch itself fills the matmuls); None: always draft
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    device: str = field(default_factory=default_device)
    # None: float32 on CPU, bfloat16 on CUDA; "auto": bfloat16 where the hardware has it (pdserve.cpu_caps)
    dtype: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    lease_ttl_s: float = 30.0
    num_threads: int | None = None
    # None: triton on CUDA, torch elsewhere (PDSERVE_ATTENTION_BACKEND overrides); "torch" | "triton" forces
    attention_backend: str | None = None
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    pack_weights: bool = True  # CPU: linear weights reordered once for oneDNN (pdserve.models.linear)
    structured: StructuredConfig = field(default_factory=StructuredConfig)  # response_format's grammars
    # weight-only linears: "none" (model dtype) | "auto" (a GGUF's Q4_x/Q8_0 tensors as stored) | "int8" |
    # "int4" | "fp8" (refused on CPU) - pdserve.models.quant_load
    quantization: str = "none"
    # ranks of one replica splitting every layer's heads and MLP (pdserve.models.tensor_parallel); CPU/gloo
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.cache.kv_cache_dtype == "float16" and not self.device.startswith("cpu"):
            raise ValueError(f"kv_cache_dtype float16 is the CPU's half-size cache; on device {self.device!r} "
                             "the cache is in the model dtype already (auto) or int8 / fp8_e4m3")
        if self.tensor_parallel_size > 1 and (self.weight_quantization != "none" or not self.device.startswith("cpu")):
            raise ValueError("tensor_parallel_size > 1 runs unquantized weights on CPU (gloo) only, got "
                             f"quantization={self.quantization!r} on device {self.device!r}")

    @property
    def weight_quantization(self) -> str:
        """What the linears are loaded as: `auto` on tensor-parallel ranks is the model dtype (quantized
        linears are not split across ranks)."""
        return "none" if self.quantization == "auto" and self.tensor_parallel_size > 1 else self.quantization

    @property
    def resolved_dtype(self) -> str:
        if self.dtype == "auto":
            from pdserve.cpu_caps import auto_dtype

            return auto_dtype(self.device)
        return self.dtype or default_dtype(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.resolved_dtype]
