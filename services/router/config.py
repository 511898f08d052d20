"""Validated router config."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

API_KEYS_ENV = "PDSERVE_API_KEYS"
API_KEYS_FILE_ENV = "PDSERVE_API_KEYS_FILE"


class RouterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    served_model_name: str = Field("tiny", min_length=1)
    model: str = "tiny"  # path or name the tokenizer is loaded from
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    # prompts shorter than this skip the prefill pool: decode prefills them locally
    disaggregate_min_prompt_tokens: int = Field(32, ge=0)
    default_max_tokens: int = Field(16, ge=1)
    max_model_len: int = Field(2048, ge=1)
    max_body_bytes: int = Field(1 << 20, ge=1)
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None  # one key per line; blank lines and '#' comments are skipped
    max_inflight: int = Field(256, ge=1)
    # a completions request runs (number of prompts) x n sequences; more than this is a 400
    max_choices_per_request: int = Field(64, ge=1)
    retry_after_s: int = Field(1, ge=0)
    health_timeout_s: float = Field(0.8, gt=0, le=1.0)  # /health waits this long at most (first stats poll)
    # Default SLOs (a request may set its own): placement targets them, and the pdserve_slo_attainment
    # gauges judge against them over a sliding window
    slo_ttft_s: float = Field(2.0, gt=0)
    slo_tpot_s: float = Field(0.2, gt=0)
    slo_window_s: float = Field(60.0, gt=0)
    metrics_staleness_s: float = Field(60.0, gt=0)
    tracing_env: dict[str, str] = Field(default_factory=dict)  # OTEL_* over the replica's process environment
    # placement: PlacementConfig fields (policy: slo_aware | least_loaded | round_robin, admission, ...);
    # slo_aware needs the latency profile written by `pdserve profile`
    placement: dict[str, Any] = Field(default_factory=dict)
    profile_path: str | None = None  # read where the app is built; its content travels in `profile`
    profile: dict[str, Any] | None = None  # a LatencyProfile as JSON
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(0.5, ge=0)
    # SSE writes: coalesced (one write per batch of what arrived meanwhile, the first at once), or one per
    # event; stream_interval_ms > 0 caps writes at one per interval, like vLLM's --stream-interval
    stream_coalesce: bool = True
    # calls to a replica whose link address is known go over pdserve.worklink, not Serve's handles
    worker_link: bool = True
    # a prompt longer than this goes from prefill to decode in parts of about this many tokens while it is
    # prefilled (decode pulls each as it comes; the prefill runs in chunks of this size), so that only the
    # last part is left to move once the first token is out; None: the whole KV after prefill
    kv_part_tokens: int | None = Field(256, ge=16)
    # a decode replica lost mid-stream: the stream moves to a live one (waiting this long for one), this often
    max_migrations: int = Field(2, ge=0)
    migration_timeout_s: float = Field(10.0, ge=0)
    stream_interval_ms: float = Field(0.0, ge=0, le=10_000)
    # what each router placed reaches the app's other routers at once, before the next stats poll:
    # auto (over Redis when the system has one), none, or redis; at most one message per flush interval
    redis_url: str | None = None  # the system's Redis (set by build_system), for placement sync
    placement_sync: Literal["auto", "none", "redis"] = "auto"
    placement_sync_flush_ms: float = Field(2.0, gt=0, le=100)
    # a request no replica can take within its SLOs (placement.admission: reject) waits here, first in first
    # out, up to queue_timeout_s, instead of a 429 at once; 0: no queue. Queued requests count in max_inflight
    queue_max_requests: int = Field(0, ge=0)
    queue_timeout_s: float = Field(2.0, gt=0, le=600)
    # GET /dashboard: tiles judged against the SLOs above and these (rates and ratios breach at or past them)
    dashboard_min_slo_attainment: float = Field(0.9, ge=0, le=1)
    dashboard_max_kv_usage: float = Field(0.9, gt=0, le=1)
    dashboard_max_error_rate: float = Field(0.01, gt=0, le=1)
    dashboard_max_fallback_rate: float = Field(0.01, gt=0, le=1)
    dashboard_max_waiting_per_replica: int = Field(8, ge=0)
    dashboard_min_live_replicas: int = Field(1, ge=1)
    dashboard_e2e_slo_s: float | None = Field(None, gt=0)  # None: TTFT SLO + TPOT SLO x (mean output tokens - 1)
    # worker snapshots (queue depth, KV usage) older than this are refreshed in the background by a poll
    dashboard_worker_refresh_s: float = Field(2.0, ge=0.5, le=60)

    @model_validator(mode="after")
    def _queue_can_fill(self) -> RouterConfig:
        if self.queue_max_requests and self.placement.get("admission") == "queue":
            raise ValueError("queue_max_requests: placement.admission 'queue' never refuses a request, so none "
                             "would wait in the router's queue; set admission 'reject' or queue_max_requests 0")
        if self.queue_max_requests >= self.max_inflight:
            raise ValueError(f"queue_max_requests ({self.queue_max_requests}) must be below max_inflight "
                             f"({self.max_inflight}): queued requests count as in flight")
        return self

    @property
    def stream_interval_s(self) -> float | None:
        return self.stream_interval_ms / 1e3 if self.stream_coalesce else None

    def resolved_api_keys(self) -> tuple[str, ...]:
        """Configured keys, those in $PDSERVE_API_KEYS (comma-separated), and those in `api_keys_file`
        or $PDSERVE_API_KEYS_FILE. Empty means no auth. A key file that cannot be read is an error."""
        keys = [*self.api_keys, *(k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(","))]
        for path in (self.api_keys_file, os.environ.get(API_KEYS_FILE_ENV)):
            if path:
                with open(path, encoding="utf-8") as f:
                    keys += [line.strip() for line in f if not line.lstrip().startswith("#")]
        return tuple(dict.fromkeys(k for k in keys if k))
