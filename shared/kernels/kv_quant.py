"""Quantized KV caches: symmetric scales per (token, KV head), stored beside the values in the block.

Plain torch, no triton: the torch attention path and the kernel wrappers both import it.

Scale layout ("token_head:float16"): each cached row x [D] of one token and one KV head is stored as
q = round(x / s) (int8, |q| <= 127) or q = fp8_e4m3(x / s) (|q| <= 448), with s = amax(|x|) / qmax
(raised a hair, floored at the smallest normal float16) rounded to float16 first, so the stored scale
is exactly the one used to quantize. Per token, so a
block fills one token at a time without requantizing anything already stored (prefix caching,
chunked prefill and handoffs see the bytes they saw before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "float16", "int8", "fp8_e4m3")  # float16: plain values, no scales
QUANT_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
SCALE_DTYPE = torch.float16
SCALE_LAYOUT = "token_head:float16"
MIN_SCALE = 2.0**-14  # the smallest normal float16: scales never go subnormal (and x / s stays finite)
# s = amax / qmax is raised by 2^-10 before rounding to float16 (relative step 2^-11), so the stored
# scale is >= amax / qmax and the largest element is never clipped
SCALE_MARGIN = 1.0 + 2.0**-10


@dataclass(frozen=True)
class QuantizedCache:
    """One layer's K (or V) cache in a quantized pool; both tensors view the pool's bytes."""

    data: torch.Tensor  # [num_blocks, block_size, Hkv, D] int8 | float8_e4m3fn, block dim strided
    scale: torch.Tensor  # [num_blocks, block_size, Hkv] float16, block dim strided
    kv_cache_dtype: str  # "int8" | "fp8_e4m3"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


def is_quantized(cache: object) -> bool:
    return isinstance(cache, QuantizedCache)


def quantize(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] int8 | float8_e4m3fn, scale [...] float16)."""
    xf = x.float()
    scale = (xf.abs().amax(-1) * (SCALE_MARGIN / QMAX[kv_cache_dtype])).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    y = xf / scale.float()[..., None]
    if kv_cache_dtype == "int8":
        # floor(y + 0.5), not torch.round (half to even): the Triton store kernel rounds the same way
        return torch.floor(y + 0.5).clamp_(-127, 127).to(torch.int8), scale
    return y.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., D], scale [...] -> x [..., D] in `dtype` (products in fp32)."""
    return (q.float() * scale.float()[..., None]).to(dtype)


def store_quantized(
    x: torch.Tensor, cache: QuantizedCache, blocks: torch.Tensor, offsets: torch.Tensor
) -> None:
    # x: [T, Hkv, D] -> rows (blocks[t], offsets[t]) of the cache; written as bytes (no fp8 index_put on CPU)
    q, scale = quantize(x, cache.kv_cache_dtype)
    cache.data.view(torch.uint8).index_put_((blocks, offsets), q.view(torch.uint8))
    cache.scale.index_put_((blocks, offsets), scale)


def gather_dequantized(
    cache: QuantizedCache, blocks: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    # blocks: [n] -> [n, block_size, Hkv, D] in `dtype`; fp32 results go into `out` when it is big enough
    # (fresh multi-MB buffers cost more in page faults than the arithmetic on CPU)
    data = cache.data.view(torch.uint8).index_select(0, blocks).view(cache.data.dtype)
    scale = cache.scale.index_select(0, blocks)
    if out is None or dtype != torch.float32 or out.dtype != dtype or out.shape[0] < blocks.numel():
        return dequantize(data, scale, dtype)
    result = out[: blocks.numel()]
    result.copy_(data)  # int8 / fp8 -> fp32 is exact
    return result.mul_(scale.float()[..., None])


def store_kvcache_quant_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: QuantizedCache, v_cache: QuantizedCache, slot_mapping: torch.Tensor
) -> None:
    # k, v: [T, Hkv, D]; slot -1 = skip
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    store_quantized(k[keep], k_cache, blocks, offsets)
    store_quantized(v[keep], v_cache, blocks, offsets)


def dequantized_cache(cache: torch.Tensor | QuantizedCache, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole cache [num_blocks, block_size, Hkv, D] in `dtype` (references and tests)."""
    if isinstance(cache, QuantizedCache):
        return dequantize(cache.data, cache.scale, dtype)
    return cache.to(dtype)
