"""Latency model: fits recover known coefficients, record their error, and survive a JSON round trip."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from pdserve.latency_model import (
    PROFILE_VERSION, DecodeModel, FitError, LatencyModel, LatencyProfile, PrefillModel, TransferModel,
    fit_nonnegative, transfer_samples_from_bench,
)

PREFILL = (0.004, 2e-5, 3e-9, 1.5e-9)  # a, b, c, d
DECODE = (0.012, 4e-4, 2e-7)
RNG_NOISE = 0.01


def _noisy(values: np.ndarray, seed: int = 0) -> np.ndarray:
    return values * (1 + np.random.default_rng(seed).uniform(-RNG_NOISE, RNG_NOISE, len(values)))


def _prefill_samples(noise: bool):
    grid = [(n, cached) for n in (16, 64, 128, 256, 512, 1024, 2048) for cached in (0, 256, 1024)]
    truth = PrefillModel(*PREFILL)
    times = np.array([truth.time_s(n, c) for n, c in grid])
    times = _noisy(times) if noise else times
    return [(n, c, t) for (n, c), t in zip(grid, times)]


def test_prefill_fit_recovers_exact_coefficients():
    fit = PrefillModel.fit(_prefill_samples(noise=False))
    assert (fit.a, fit.b, fit.c, fit.d) == pytest.approx(PREFILL, rel=1e-6)
    assert fit.error.max_rel < 1e-9 and fit.error.num_samples == 21


def test_prefill_fit_with_noise_records_its_error():
    samples = _prefill_samples(noise=True)
    fit = PrefillModel.fit(samples)
    assert fit.a == pytest.approx(PREFILL[0], rel=0.1)
    assert fit.b == pytest.approx(PREFILL[1], rel=0.1)
    assert fit.c == pytest.approx(PREFILL[2], rel=0.2)
    assert fit.d == pytest.approx(PREFILL[3], rel=0.2)
    rel = [abs(fit.time_s(n, c) - t) / t for n, c, t in samples]
    assert fit.error == FitError(pytest.approx(max(rel)), pytest.approx(float(np.mean(rel))), len(samples))
    assert 0 < fit.error.mean_rel <= fit.error.max_rel <= 2 * RNG_NOISE


def test_decode_fit_recovers_coefficients():
    grid = [(b, b * ctx) for b in (1, 2, 4, 8, 16, 32, 64) for ctx in (32, 256, 1024)]
    truth = DecodeModel(*DECODE)
    times = _noisy(np.array([truth.step_s(b, c) for b, c in grid]), seed=1)
    fit = DecodeModel.fit([(b, c, t) for (b, c), t in zip(grid, times)])
    assert (fit.a, fit.b, fit.c) == pytest.approx(DECODE, rel=0.1)
    assert fit.error.max_rel <= 2 * RNG_NOISE


def test_transfer_fit_recovers_latency_and_bandwidth():
    sizes = [1 << 20, 16 << 20, 64 << 20, 256 << 20]
    fit = TransferModel.fit([(s, 0.002 + s / 1e9) for s in sizes])
    assert fit.latency_s == pytest.approx(0.002, rel=1e-6)
    assert fit.bandwidth_bytes_s == pytest.approx(1e9, rel=1e-6)
    assert fit.time_s(0) == 0.0
    with pytest.raises(ValueError, match="more than one size"):
        TransferModel.fit([(1 << 20, 0.01)] * 3)


def test_fit_keeps_coefficients_nonnegative():
    # time falls slightly with n: an unconstrained fit would give a negative slope
    x = np.array([[1.0, n] for n in (10, 20, 30, 40)])
    coef, error = fit_nonnegative(x, np.array([1.0, 0.99, 0.98, 0.97]))
    assert coef[1] == 0.0 and coef[0] > 0
    assert error.max_rel < 0.02
    with pytest.raises(ValueError):
        fit_nonnegative(x, np.array([1.0, 0.0, 1.0, 1.0]))


def _model() -> LatencyModel:
    return LatencyModel(
        PrefillModel(0.01, 1e-4, 1e-8, 2e-8, FitError(0.05, 0.02, 12)), DecodeModel(0.02, 1e-3, 1e-6),
        kv_bytes_per_token=4096, transfers={"redis": TransferModel(0.005, 2e8, FitError(0.1, 0.05, 4))},
    )


@pytest.mark.parametrize("batch,context,chunk,expected", [
    (0, 0, 100, 0.01 + 1e-2 + 1e-4),  # no decodes: a prefill step
    (4, 1000, 0, 0.02 + 4e-3 + 1e-3),  # no chunk: a decode step
    (4, 1000, 100, 0.02 + 4e-3 + 1e-3 + 1e-2 + 1e-4),  # both: the step overhead once
])
def test_mixed_step(batch, context, chunk, expected):
    assert _model().mixed_step_s(batch, context, chunk) == pytest.approx(expected)


def test_transfer_lookup():
    model = _model()
    assert model.kv_transfer_s(1000, "redis") == pytest.approx(0.005 + 4096 * 1000 / 2e8)
    with pytest.raises(KeyError, match="ucx"):
        model.transfer_s(1, "ucx")


def test_profile_json_round_trip(tmp_path):
    other = LatencyModel(PrefillModel(1, 2, 3), DecodeModel(4, 5, 6), kv_bytes_per_token=8)
    profile = LatencyProfile({"prefill": _model(), "decode": other}, command="pdserve profile --quick",
                             meta={"model": "tiny"})
    path = tmp_path / "profile.json"
    profile.save(path)
    loaded = LatencyProfile.load(path)
    assert loaded == profile
    assert loaded.to_dict()["version"] == PROFILE_VERSION
    errors = loaded.for_role("prefill").fit_errors()
    assert errors["transfer.redis"] == {"max_rel": 0.1, "mean_rel": 0.05, "num_samples": 4}
    with pytest.raises(KeyError):
        loaded.for_role("router")
    assert LatencyProfile({"default": _model()}).for_role("decode") == _model()


def test_profile_rejects_other_versions():
    data = LatencyProfile({"default": _model()}).to_dict()
    data["version"] = PROFILE_VERSION + 1
    with pytest.raises(ValueError, match="version"):
        LatencyProfile.from_dict(data)


def test_transfer_samples_from_bench_output():
    bench = {"rows": [
        {"transport": "redis", "bytes": 1 << 20, "gb_s": 0.2},
        {"transport": "redis", "bytes": 16 << 20, "gb_s": 0.4},
        {"transport": "local", "bytes": 1 << 20, "gb_s": 4.0},
    ]}
    samples = transfer_samples_from_bench(bench)
    assert sorted(samples) == ["local", "redis"]
    assert samples["redis"][1] == (16 << 20, pytest.approx((16 << 20) / 0.4e9))


def test_latency_model_is_torch_free():
    code = "import sys, pdserve.latency_model, pdserve.plan; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
