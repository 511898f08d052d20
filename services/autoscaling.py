"""A role's opt-in SLO-driven autoscaling (`prefill.autoscaling`, `decode.autoscaling` in SystemConfig),
validated when the config loads, and the Serve `autoscaling_config` it becomes: a deployment-level custom
policy (pdserve.autoscale.serve_policy.SLORolePolicy) over the replicas' `record_autoscaling_stats`.

Unset SLO and hysteresis settings take pdserve.autoscale.AutoscaleConfig's defaults. Serve's own delays are
set to 0 (the policy's hysteresis is the only one); `window_s` is Serve's `look_back_period_s` (the span
of the replicas' metric series the rates come from) and `metrics_interval_s` how often replicas record and
push them. A replica chosen for removal drains for up to `drain_timeout_s` (its link calls end, its KV
exports are pulled) before Serve's graceful-shutdown deadline, set a few seconds past it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.autoscale import POLICIES, AutoscaleConfig, RoleBounds
from pdserve.autoscale.serve_policy import POLICY_PATH
from pdserve.latency_model import LatencyProfile

SHUTDOWN_MARGIN_S = 5.0  # Serve's force-kill deadline past the drain: engine, transport and tracer close


def _strip(exc: ValueError) -> str:
    """AutoscaleConfig's `autoscale.prefill.min_replicas: ...` as this section's `min_replicas: ...`."""
    message = str(exc).removeprefix("autoscale.")
    for role in ("prefill.", "decode."):
        message = message.removeprefix(role)
    return message


class RoleAutoscaling(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    policy: str = "slo"  # slo | static (the role's num_replicas, held)
    min_replicas: int = 1
    max_replicas: int = 4
    # the latency profile `pdserve profile` writes: read where the config loads, its content travels in `profile`
    profile_path: str | None = None
    profile: dict[str, Any] | None = None
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    target_attainment: float | None = None
    tpot_headroom: float | None = None
    kv_target_usage: float | None = None
    service_cv2: float | None = None
    upscale_delay_s: float | None = None
    downscale_delay_s: float | None = None
    cooldown_s: float | None = None
    downscale_band: float | None = None
    backlog_drain_s: float | None = None
    max_step: int | None = None
    window_s: float | None = None
    metrics_interval_s: float = Field(10.0, gt=0)
    drain_timeout_s: float = Field(60.0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _read_profile(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("profile_path") and data.get("profile") is None:
            path = data["profile_path"]
            try:
                profile = json.loads(Path(path).read_text())
            except OSError as exc:
                raise ValueError(f"profile_path: cannot read {path}: {exc.strerror or exc}") from None
            except ValueError as exc:
                raise ValueError(f"profile_path: {path} is not JSON ({exc})") from None
            data = {**data, "profile": profile}
        return data

    @model_validator(mode="after")
    def _can_work(self) -> RoleAutoscaling:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: unknown policy {self.policy!r}; known: {list(POLICIES)}")
        try:
            config = self.autoscale_config()
        except ValueError as exc:
            raise ValueError(_strip(exc)) from None
        if self.policy == "slo":
            if self.profile is None:
                raise ValueError("profile_path: the slo policy needs a latency profile (`pdserve profile` writes one)")
            if config.window_s <= self.metrics_interval_s:
                raise ValueError(f"window_s: {config.window_s} must be above metrics_interval_s "
                                 f"{self.metrics_interval_s} (a rate needs two points in the window)")
            self.latency_profile()
        return self

    def latency_profile(self) -> LatencyProfile:
        try:
            return LatencyProfile.from_dict(self.profile or {})
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"profile: not a latency profile ({type(exc).__name__}: {exc})") from None

    def autoscale_config(self) -> AutoscaleConfig:
        """The pure policy's config; both roles' bounds are this role's (the policy sizes only its own)."""
        given = {k: v for k, v in self.model_dump(include=set(AutoscaleConfig.__dataclass_fields__)).items()
                 if v is not None}
        bounds = RoleBounds(self.min_replicas, self.max_replicas)
        return AutoscaleConfig(**{**given, "prefill": bounds, "decode": bounds})

    def check_profile(self, block_size: int) -> None:
        """Targets that no replica count can meet on the profile's hardware are refused, naming the field."""
        if self.policy != "slo":
            return
        try:
            self.autoscale_config().check_profile(self.latency_profile(), block_size)
        except ValueError as exc:
            raise ValueError(f"autoscaling.{_strip(exc)}") from None

    def serve_autoscaling_config(self, num_replicas: int, transport: str | None = None,
                                 role: str | None = None) -> dict[str, Any]:
        """Serve's `autoscaling_config` for the deployment: `num_replicas` (clipped) is its initial count."""
        config = self.autoscale_config()
        kwargs = {"config": {k: v for k, v in self.model_dump(include=set(AutoscaleConfig.__dataclass_fields__))
                             .items() if v is not None}
                  | {"prefill": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas},
                     "decode": {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas}},
                  "profile": self.profile, "role": role, "transport": transport}
        return {
            "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
            "initial_replicas": min(max(num_replicas, self.min_replicas), self.max_replicas),
            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0,
            "look_back_period_s": config.window_s, "metrics_interval_s": self.metrics_interval_s,
            "policy": {"policy_function": POLICY_PATH, "policy_kwargs": kwargs},
        }

    @property
    def graceful_shutdown_timeout_s(self) -> float:
        return self.drain_timeout_s + SHUTDOWN_MARGIN_S
