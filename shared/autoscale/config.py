"""Autoscaling settings per role, validated when they load: an impossible setting names its field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from pdserve.latency_model import LatencyProfile

POLICIES = ("slo", "static")
ROLES = ("prefill", "decode")


def _field_error(name: str, message: str) -> ValueError:
    return ValueError(f"autoscale.{name}: {message}")


@dataclass(frozen=True)
class RoleBounds:
    min_replicas: int = 1
    max_replicas: int = 16


@dataclass(frozen=True)
class AutoscaleConfig:
    """`slo`: each role sized on its predicted SLO attainment (pdserve.autoscale.policy); `static`: held."""

    policy: str = "slo"
    prefill: RoleBounds = field(default_factory=RoleBounds)
    decode: RoleBounds = field(default_factory=RoleBounds)
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.2
    target_attainment: float = 0.95  # predicted share of requests within their role's SLO
    # a role's step time may use at most this share of the TPOT SLO (the rest absorbs prefill chunks)
    tpot_headroom: float = 0.8
    kv_target_usage: float = 0.8  # decode KV blocks in use, as a share of the pool, to size for
    # squared coefficient of variation of prefill service time, when the stats carry no prompt-length spread
    service_cv2: float = 1.0
    upscale_delay_s: float = 30.0  # a role's need stays above its count this long before it grows
    downscale_delay_s: float = 600.0  # ... stays below it this long before it shrinks
    cooldown_s: float = 300.0  # after a change, no change in the opposite direction for this long
    downscale_band: float = 0.2  # shrink only to the count that the load needs at (1 - band) of capacity
    backlog_drain_s: float = 60.0  # prefill: queued prompt tokens are worked off over this long
    max_step: int = 4  # replicas added or removed per role per decision
    window_s: float = 120.0  # the stats' window (arrival rate, lengths, attainment)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise _field_error("policy", f"unknown policy {self.policy!r}; known: {list(POLICIES)}")
        for role in ROLES:
            bounds = getattr(self, role)
            if bounds.min_replicas < 0:
                raise _field_error(f"{role}.min_replicas", f"must be >= 0, got {bounds.min_replicas}")
            if bounds.max_replicas < 1:
                raise _field_error(f"{role}.max_replicas", f"must be >= 1, got {bounds.max_replicas}")
            if bounds.min_replicas > bounds.max_replicas:
                raise _field_error(f"{role}.min_replicas", f"{bounds.min_replicas} is above max_replicas "
                                   f"{bounds.max_replicas}")
        for name in ("ttft_slo_s", "tpot_slo_s", "window_s", "backlog_drain_s"):
            if not getattr(self, name) > 0:
                raise _field_error(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("target_attainment", "tpot_headroom", "kv_target_usage"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise _field_error(name, f"must be in (0, 1], got {value}")
        for name in ("upscale_delay_s", "downscale_delay_s", "cooldown_s", "service_cv2"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise _field_error(name, f"must be a finite number >= 0, got {value}")
        if not 0 <= self.downscale_band < 1:
            raise _field_error("downscale_band", f"must be in [0, 1), got {self.downscale_band}")
        if self.max_step < 1:
            raise _field_error("max_step", f"must be >= 1, got {self.max_step}")

    def bounds(self, role: str) -> RoleBounds:
        return getattr(self, role)

    def check_profile(self, profile: LatencyProfile, block_size: int = 16) -> None:
        """Refuses SLOs that no replica count can meet on this hardware: one block's prefill above the TTFT
        SLO, or a batch-1 decode step above the TPOT SLO's headroom."""
        prefill, decode = profile.for_role("prefill"), profile.for_role("decode")
        if prefill.prefill_time_s(block_size) > self.ttft_slo_s:
            raise _field_error("ttft_slo_s", f"{self.ttft_slo_s} s is below one {block_size}-token prefill "
                               f"({prefill.prefill_time_s(block_size):.4g} s) on this profile")
        if decode.decode_step_s(1, 1) > self.tpot_slo_s * self.tpot_headroom:
            raise _field_error("tpot_slo_s", f"{self.tpot_slo_s} s x tpot_headroom {self.tpot_headroom} is below "
                               f"a batch-1 decode step ({decode.decode_step_s(1, 1):.4g} s) on this profile")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AutoscaleConfig:
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                raise _field_error(key, "unknown setting")
        values = dict(data)
        for role in ROLES:
            if role in values:
                bounds = dict(values[role])
                unknown = set(bounds) - {"min_replicas", "max_replicas"}
                if unknown:
                    raise _field_error(f"{role}.{min(unknown)}", "unknown setting")
                values[role] = RoleBounds(**bounds)
        return cls(**values)
