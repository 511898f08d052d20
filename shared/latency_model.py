"""Per-role latency model (DistServe style): least-squares fits of prefill, decode-step and KV-transfer time.

- prefill_time_s(n, cached) = a + b·n + c·n² + d·n·cached. Linear layers cost ∝ n; causal attention of
  the n new tokens over themselves ∝ n²/2, and over the cached prefix ∝ n·cached; `a` is the per-step
  overhead (Python, scheduling, launch).
- decode_step_s(batch, context) = a + b·batch + c·context. One weight pass per step (`a`), per-row
  compute (`b`), and attention reads every context token's K/V once (`c`; context summed over the batch).
- transfer_s(nbytes, transport) = latency + nbytes / bandwidth, per transport.

Fits minimise relative error (each row weighted by 1/t), the error we record and route on: short
prompts matter as much as long ones. Coefficients are kept non-negative, so no prediction goes below
the step overhead. Torch-free: the router imports this.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PROFILE_VERSION = 1
TRANSFER_KEYS = ("latency_s", "bandwidth_bytes_s")


@dataclass(frozen=True)
class FitError:
    """Relative error |predicted - measured| / measured over the fitted samples."""

    max_rel: float
    mean_rel: float
    num_samples: int


def fit_nonnegative(features: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, FitError]:
    """Relative least squares with coefficients >= 0: terms whose unconstrained fit goes negative are
    dropped (fixed at 0) one at a time, most negative first, and the rest refitted."""
    features = np.asarray(features, dtype=np.float64)
    seconds = np.asarray(seconds, dtype=np.float64)
    if features.ndim != 2 or len(features) != len(seconds) or len(seconds) == 0:
        raise ValueError("need one feature row per sample and at least one sample")
    if np.any(seconds <= 0):
        raise ValueError("measured times must be positive")
    weighted = features / seconds[:, None]
    active = list(range(features.shape[1]))
    coef = np.zeros(features.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(weighted[:, active], np.ones(len(seconds)), rcond=None)
        if np.all(sol >= 0):
            coef[active] = sol
            break
        del active[int(np.argmin(sol))]
    rel = np.abs(features @ coef - seconds) / seconds
    return coef, FitError(float(rel.max()), float(rel.mean()), len(seconds))


@dataclass(frozen=True)
class PrefillModel:
    a: float
    b: float
    c: float
    d: float = 0.0
    error: FitError | None = None

    def time_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens <= 0:
            return 0.0
        n = float(new_tokens)
        return self.a + self.b * n + self.c * n * n + self.d * n * cached_tokens

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]]) -> PrefillModel:
        """samples: (new_tokens, cached_tokens, seconds)."""
        rows = np.array(list(samples), dtype=np.float64).reshape(-1, 3)
        n, cached, t = rows[:, 0], rows[:, 1], rows[:, 2]
        coef, error = fit_nonnegative(np.stack([np.ones_like(n), n, n * n, n * cached], axis=1), t)
        return cls(*map(float, coef), error=error)


@dataclass(frozen=True)
class DecodeModel:
    a: float
    b: float
    c: float
    error: FitError | None = None

    def step_s(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        return self.a + self.b * batch_size + self.c * context_tokens

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]]) -> DecodeModel:
        """samples: (batch_size, total context tokens over the batch, seconds per step)."""
        rows = np.array(list(samples), dtype=np.float64).reshape(-1, 3)
        batch, context, t = rows[:, 0], rows[:, 1], rows[:, 2]
        coef, error = fit_nonnegative(np.stack([np.ones_like(batch), batch, context], axis=1), t)
        return cls(*map(float, coef), error=error)


@dataclass(frozen=True)
class TransferModel:
    latency_s: float
    bandwidth_bytes_s: float
    error: FitError | None = None

    def __post_init__(self) -> None:
        if self.latency_s < 0 or self.bandwidth_bytes_s <= 0:
            raise ValueError("latency must be >= 0 and bandwidth > 0")

    def time_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_s if nbytes > 0 else 0.0

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, float]]) -> TransferModel:
        """samples: (bytes moved, seconds)."""
        rows = np.array(list(samples), dtype=np.float64).reshape(-1, 2)
        nbytes, t = rows[:, 0], rows[:, 1]
        if len(np.unique(nbytes)) < 2:
            raise ValueError("latency and bandwidth need samples of more than one size")
        coef, error = fit_nonnegative(np.stack([np.ones_like(nbytes), nbytes], axis=1), t)
        if coef[1] <= 0:
            raise ValueError("transfer samples show no per-byte cost")
        return cls(float(coef[0]), float(1.0 / coef[1]), error)


@dataclass(frozen=True)
class LatencyModel:
    """One worker role's hardware: prefill and decode fits, KV transports, and the KV size per token."""

    prefill: PrefillModel
    decode: DecodeModel
    kv_bytes_per_token: int
    transfers: Mapping[str, TransferModel] = field(default_factory=dict)

    def prefill_time_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self.prefill.time_s(new_tokens, cached_tokens)

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        return self.decode.step_s(batch_size, context_tokens)

    def mixed_step_s(
        self, batch_size: int, context_tokens: int, chunk_tokens: int, cached_tokens: int = 0
    ) -> float:
        """One engine step running `batch_size` decodes and a prefill chunk: the step overhead counts once."""
        if batch_size <= 0:
            return self.prefill_time_s(chunk_tokens, cached_tokens)
        if chunk_tokens <= 0:
            return self.decode_step_s(batch_size, context_tokens)
        extra = self.prefill_time_s(chunk_tokens, cached_tokens) - self.prefill.a
        return self.decode_step_s(batch_size, context_tokens) + max(extra, 0.0)

    def transfer_s(self, nbytes: int, transport: str) -> float:
        try:
            return self.transfers[transport].time_s(nbytes)
        except KeyError:
            known = sorted(self.transfers)
            raise KeyError(f"no transfer model for transport {transport!r}; have {known}") from None

    def kv_transfer_s(self, num_tokens: int, transport: str) -> float:
        return self.transfer_s(num_tokens * self.kv_bytes_per_token, transport)

    def fit_errors(self) -> dict[str, Any]:
        errors = {"prefill": self.prefill.error, "decode": self.decode.error,
                  **{f"transfer.{k}": v.error for k, v in self.transfers.items()}}
        return {k: None if e is None else _error_dict(e) for k, e in errors.items()}


@dataclass(frozen=True)
class LatencyProfile:
    """A profile file: latency models by worker role ("prefill", "decode"; "default" serves any role)."""

    models: Mapping[str, LatencyModel]
    command: str = ""  # the command that produced it
    meta: Mapping[str, Any] = field(default_factory=dict)
    version: int = PROFILE_VERSION

    def for_role(self, role: str) -> LatencyModel:
        model = self.models.get(role) or self.models.get("default")
        if model is None:
            roles = sorted(self.models)
            raise KeyError(f"profile has no model for role {role!r} and no 'default'; roles: {roles}")
        return model

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "command": self.command, "meta": dict(self.meta),
                "models": {role: _model_dict(m) for role, m in self.models.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LatencyProfile:
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(f"profile version {version!r} is not supported (expected {PROFILE_VERSION})")
        models = {role: _model_from_dict(m) for role, m in data["models"].items()}
        return cls(models, data.get("command", ""), dict(data.get("meta", {})), version)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LatencyProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def transfer_samples_from_bench(result: Mapping[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """(bytes, seconds) per transport from the JSON that `pdserve bench transfer --json` prints."""
    samples: dict[str, list[tuple[int, float]]] = {}
    for row in result.get("rows", ()):
        if row.get("gb_s", 0) > 0 and row.get("endpoint_error_handling", True):  # the workers' default UCX config
            seconds = row["bytes"] / (row["gb_s"] * 1e9)
            samples.setdefault(row["transport"], []).append((int(row["bytes"]), seconds))
    return samples


def _error_dict(error: FitError) -> dict[str, Any]:
    return {"max_rel": error.max_rel, "mean_rel": error.mean_rel, "num_samples": error.num_samples}


def _error_from(data: Mapping[str, Any] | None) -> FitError | None:
    if data is None:
        return None
    return FitError(float(data["max_rel"]), float(data["mean_rel"]), int(data["num_samples"]))


def _model_dict(model: LatencyModel) -> dict[str, Any]:
    def fit(obj: Any, keys: Sequence[str]) -> dict[str, Any]:
        error = None if obj.error is None else _error_dict(obj.error)
        return {**{k: getattr(obj, k) for k in keys}, "error": error}

    return {
        "kv_bytes_per_token": model.kv_bytes_per_token,
        "prefill": fit(model.prefill, "abcd"),
        "decode": fit(model.decode, "abc"),
        "transfers": {name: fit(t, TRANSFER_KEYS) for name, t in model.transfers.items()},
    }


def _model_from_dict(data: Mapping[str, Any]) -> LatencyModel:
    def coefs(d: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
        values = {k: float(d[k]) for k in keys}
        if not all(math.isfinite(v) for v in values.values()):
            raise ValueError(f"non-finite coefficient in {dict(d)}")
        return {**values, "error": _error_from(d.get("error"))}

    return LatencyModel(
        prefill=PrefillModel(**coefs(data["prefill"], "abcd")),
        decode=DecodeModel(**coefs(data["decode"], "abc")),
        kv_bytes_per_token=int(data["kv_bytes_per_token"]),
        transfers={n: TransferModel(**coefs(t, TRANSFER_KEYS))
                   for n, t in data.get("transfers", {}).items()},
    )
