"""KV pool storage per `kv_cache_dtype`: the byte size of a block and the per-layer cache views.

auto: the pool is typed by the model dtype, [num_blocks, num_layers, 2, block_size, Hkv, D].
float16: the same layout in float16 whatever the model dtype (half a float32 model's bytes; attention
    reads the values back as the model dtype).
int8 | fp8_e4m3: the pool is bytes, [num_blocks, block_nbytes]; each block holds, in this order,
    values  [num_layers, 2, block_size, Hkv, D]   int8 | float8_e4m3fn
    scales  [num_layers, 2, block_size, Hkv]      float16 (one per token and KV head)
so a block (all layers, K and V, scales) is still one contiguous region the transports move whole.
"""

from __future__ import annotations

import torch

from pdserve.kernels.kv_quant import KV_CACHE_DTYPES, QUANT_DTYPES, SCALE_DTYPE, QuantizedCache
from pdserve.kvcache.pool import allocate_pool
from pdserve.models.config import ModelConfig

KVCaches = list[tuple[torch.Tensor, torch.Tensor]] | list[tuple[QuantizedCache, QuantizedCache]]


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return kv_cache_dtype


def is_quantized_dtype(kv_cache_dtype: str) -> bool:
    """Values with scales (int8, fp8_e4m3); auto and float16 are plain values."""
    return check_kv_cache_dtype(kv_cache_dtype) in QUANT_DTYPES


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def value_dtype(model_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The dtype of the stored K/V values."""
    if kv_cache_dtype == "float16":
        return torch.float16
    return QUANT_DTYPES[kv_cache_dtype] if is_quantized_dtype(kv_cache_dtype) else model_dtype


def kv_bytes_per_token(config: ModelConfig, model_dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Pool bytes one token takes over all layers, K and V, scales included."""
    rows = config.num_layers * 2 * config.num_kv_heads  # rows of head_dim values per token
    values = rows * config.head_dim * _itemsize(value_dtype(model_dtype, kv_cache_dtype))
    return values + (rows * _itemsize(SCALE_DTYPE) if is_quantized_dtype(kv_cache_dtype) else 0)


def kv_block_nbytes(config: ModelConfig, block_size: int, model_dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    return block_size * kv_bytes_per_token(config, model_dtype, kv_cache_dtype)


def allocate_kv_cache(
    config: ModelConfig, block_size: int, num_blocks: int, model_dtype: torch.dtype, kv_cache_dtype: str,
    device: torch.device | str,
) -> tuple[torch.Tensor, KVCaches]:
    """The pool (contiguous, first dim = blocks) and one (k_cache, v_cache) per layer viewing it."""
    layers, heads, dim = config.num_layers, config.num_kv_heads, config.head_dim
    if not is_quantized_dtype(kv_cache_dtype):
        pool = allocate_pool((num_blocks, layers, 2, block_size, heads, dim), value_dtype(model_dtype, kv_cache_dtype),
                             device)
        return pool, [(pool[:, i, 0], pool[:, i, 1]) for i in range(layers)]
    nbytes = kv_block_nbytes(config, block_size, model_dtype, kv_cache_dtype)
    pool = allocate_pool((num_blocks, nbytes), torch.uint8, device)
    return pool, quantized_views(pool, layers, block_size, heads, dim, kv_cache_dtype)


def quantized_views(
    pool: torch.Tensor, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
) -> list[tuple[QuantizedCache, QuantizedCache]]:
    values, scales = value_scale_views(pool, num_layers, block_size, num_kv_heads, head_dim, kv_cache_dtype)
    return [
        (QuantizedCache(values[:, i, 0], scales[:, i, 0], kv_cache_dtype),
         QuantizedCache(values[:, i, 1], scales[:, i, 1], kv_cache_dtype))
        for i in range(num_layers)
    ]


def value_scale_views(
    pool: torch.Tensor, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """pool: [num_blocks, block_nbytes] uint8 -> values [num_blocks, L, 2, bs, Hkv, D] and scales
    [num_blocks, L, 2, bs, Hkv], both viewing it."""
    num_blocks = pool.shape[0]
    num_values = num_layers * 2 * block_size * num_kv_heads * head_dim  # one byte each
    values = pool[:, :num_values].view(QUANT_DTYPES[kv_cache_dtype])
    values = values.view(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    scales = pool[:, num_values:].view(SCALE_DTYPE).view(num_blocks, num_layers, 2, block_size, num_kv_heads)
    return values, scales
