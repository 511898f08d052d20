from __future__ import annotations

import pytest
from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel, TransferModel


@pytest.fixture
def profile() -> LatencyProfile:
    """Round numbers: prefill 10 ms + 0.1 ms/token (+ quadratic and cached terms), decode 5 ms + 0.1 ms/row +
    1 us per context token, KV 1 KiB/token over ucx at 1 GB/s after 2 ms."""
    model = LatencyModel(PrefillModel(0.01, 1e-4, 1e-8, 2e-8), DecodeModel(0.005, 1e-4, 1e-6), 1024,
                         {"ucx": TransferModel(0.002, 1e9)})
    return LatencyProfile({"default": model})
