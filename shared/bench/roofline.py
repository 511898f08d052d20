"""Physical limits of this machine, measured in the same run as the engine."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth_gb_s(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best read bandwidth over a few reductions of a >= 1 GiB float32 tensor."""
    return tensor_read_gb_s(torch.ones(num_bytes // 4, dtype=torch.float32), repeats)


def tensor_read_gb_s(x: torch.Tensor, repeats: int = 5) -> float:
    """Best read bandwidth over `repeats` sums and as many maxima of x (float32, far larger than the caches)."""
    seconds = min(best_time(lambda: x.sum(), repeats), best_time(lambda: x.amax(), repeats))
    return x.numel() * x.element_size() / seconds / 1e9


def gemv_bandwidth_gb_s(num_bytes: int, in_features: int = 768, repeats: int = 5) -> float:
    """Bandwidth of torch's fp32 matrix-vector product on one weight-sized matrix."""
    weight = torch.randn(max(1, num_bytes // (4 * in_features)), in_features)
    vector = torch.randn(in_features)
    return weight.numel() * 4 / best_time(lambda: torch.mv(weight, vector), repeats) / 1e9
