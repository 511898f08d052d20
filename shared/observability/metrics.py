"""Serving metrics for one replica (router, prefill or decode), in a registry of its own.

Every series is labelled role/replica/model. Workers return `snapshot()` (plain data) to the router,
whose `render(worker_snapshots)` is the single /metrics exposition for the whole deployment.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from pdserve.observability.metrics_snapshot import CONTENT_TYPE, Snapshot, render, snapshot_of
from pdserve.observability.slo import SloWindow, time_per_output_token
from pdserve.observability.step_metrics import StepCollector

LABELS = ("role", "replica", "model")

TTFT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
)
TPOT_BUCKETS = (
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
KV_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
KV_BYTES_BUCKETS = tuple(float(4**k) for k in range(8, 17))  # 64 KiB .. 4 GiB

__all__ = ["CONTENT_TYPE", "LABELS", "ServingMetrics", "SloCollector", "render"]


class SloCollector:
    """`pdserve_slo_attainment{slo="ttft"|"tpot"|"both"}` over a SloWindow, plus the window's request count
    and the targets. Attainment is absent (not 0) while the window is empty."""

    def __init__(self, window: SloWindow, label_values: tuple[str, ...]) -> None:
        self.window = window
        self._labels = list(label_values)

    def collect(self) -> Iterator[Metric]:
        att = self.window.attainment()
        ratio = GaugeMetricFamily(
            "pdserve_slo_attainment",
            "Share of requests in the window meeting the SLO",
            labels=[*LABELS, "slo"],
        )
        if att.requests:
            for slo, value in (("ttft", att.ttft), ("tpot", att.tpot), ("both", att.both)):
                ratio.add_metric([*self._labels, slo], value)
        requests = GaugeMetricFamily(
            "pdserve_slo_window_requests", "Requests in the SLO window", labels=LABELS
        )
        requests.add_metric(self._labels, att.requests)
        target = GaugeMetricFamily("pdserve_slo_target_seconds", "SLO targets", labels=[*LABELS, "slo"])
        target.add_metric([*self._labels, "ttft"], self.window.ttft_slo_s)
        target.add_metric([*self._labels, "tpot"], self.window.tpot_slo_s)
        window = GaugeMetricFamily("pdserve_slo_window_seconds", "Length of the SLO window", labels=LABELS)
        window.add_metric(self._labels, self.window.window_s)
        yield from (ratio, requests, target, window)

    def describe(self) -> list[Metric]:
        return []


class RedisHealth(Protocol):
    up: bool | None  # None until the first probe


class RedisUpCollector:
    """`pdserve_redis_up`: 1 while the Redis tier answers its probe, 0 while it does not."""

    def __init__(self, probe: RedisHealth, label_values: tuple[str, ...]) -> None:
        self.probe = probe
        self._labels = list(label_values)

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("pdserve_redis_up", "Whether the Redis tier answers its health probe", labels=LABELS)
        if self.probe.up is not None:
            up.add_metric(self._labels, 1.0 if self.probe.up else 0.0)
        yield up

    def describe(self) -> list[Metric]:
        return []


class ServingMetrics:
    """Recording methods for the hot path; `snapshot()` to ship; `render(others)` to expose."""

    def __init__(self, role: str, replica: str, model: str, *, slo: SloWindow | None = None) -> None:
        self.labels = (role, replica, model)
        self.registry = r = CollectorRegistry()
        self.slo = slo

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r).labels(*self.labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r).labels(*self.labels)

        self._ttft = histogram("pdserve_time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self._tpot = histogram(
            "pdserve_time_per_output_token_seconds",
            "Mean time per output token after the first",
            TPOT_BUCKETS,
        )
        self._e2e = histogram(
            "pdserve_e2e_request_latency_seconds", "Request latency, end to end", REQUEST_BUCKETS
        )
        self._queue = histogram(
            "pdserve_request_queue_seconds", "Time waiting before scheduling", TTFT_BUCKETS
        )
        self._prefill = histogram("pdserve_request_prefill_seconds", "Time spent in prefill", TTFT_BUCKETS)
        self._decode = histogram("pdserve_request_decode_seconds", "Time spent in decode", REQUEST_BUCKETS)
        self._kv_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "KV cache transfer time",
            [*LABELS, "transport"],
            buckets=KV_SECONDS_BUCKETS,
            registry=r,
        )
        self._kv_exposed = Histogram(
            "pdserve_kv_transfer_exposed_seconds",
            "KV transfer time the stream waited for after prefill ended (the rest overlapped prefill)",
            [*LABELS, "transport"],
            buckets=KV_SECONDS_BUCKETS,
            registry=r,
        )
        self._kv_bytes = Histogram(
            "pdserve_kv_transfer_bytes",
            "KV cache bytes per transfer",
            [*LABELS, "transport"],
            buckets=KV_BYTES_BUCKETS,
            registry=r,
        )
        self._kv_usage = gauge("pdserve_kv_cache_usage_ratio", "Share of KV cache blocks in use (0..1)")
        self._running = gauge("pdserve_requests_running", "Requests being processed")
        self._waiting = gauge("pdserve_requests_waiting", "Requests queued")
        self._prefix_hits = Counter(
            "pdserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache, by where the "
            "blocks came from (local: this pool; redis: pulled from the Redis tier)", [*LABELS, "source"], registry=r,
        )
        for source in ("local", "redis"):  # both series from the start, at 0
            self._prefix_hits.labels(*self.labels, source)
        self._prompt_tokens = counter("pdserve_prompt_tokens", "Prompt tokens admitted")
        self._generation_tokens = counter("pdserve_generation_tokens", "Tokens generated")
        self._decisions = Counter(
            "pdserve_disaggregation_decisions",
            "Disaggregate/skip decisions",
            [*LABELS, "decision", "reason"],
            registry=r,
        )
        self._fallbacks = Counter(
            "pdserve_fallbacks", "Fallbacks from the disaggregated path", [*LABELS, "reason"], registry=r
        )
        self._rejections = Counter("pdserve_rejections", "Requests rejected", [*LABELS, "reason"], registry=r)
        self._spec_draft = counter("pdserve_spec_draft_tokens", "Draft tokens proposed for verification")
        self._spec_accepted = counter("pdserve_spec_accepted_tokens", "Draft tokens accepted by the target model")
        self._spec_verifications = counter("pdserve_spec_verifications", "Decode steps that verified a draft")
        self._spec_acceptance = gauge("pdserve_spec_acceptance_rate", "Accepted / drafted tokens (0..1), cumulative")
        self._spec_mean_accepted = gauge(
            "pdserve_spec_mean_accepted_length", "Draft tokens accepted per verification step, cumulative"
        )
        self._spec_totals = [0, 0, 0]  # drafted, accepted, verifications
        self._kv_leases = Gauge("pdserve_kv_leases", "KV leases by state: held (in the engine's lease table), "
                                "exported (offered by the KV transport, not yet pulled)", [*LABELS, "state"], registry=r)
        self._kv_lease_oldest = gauge(
            "pdserve_kv_lease_oldest_seconds", "Age of the oldest KV lease still held (0 with none)")
        self._kv_leases_expired = counter(
            "pdserve_kv_leases_expired", "KV leases that expired before decode adopted them")
        self._num_expired_leases = 0
        self.steps = StepCollector(self.labels)  # engine replicas update it from their EngineStats
        r.register(self.steps)
        if slo is not None:
            r.register(SloCollector(slo, self.labels))

    # ---- latencies (seconds)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self._tpot.observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def observe_queue(self, seconds: float) -> None:
        self._queue.observe(seconds)

    def observe_prefill(self, seconds: float) -> None:
        self._prefill.observe(seconds)

    def observe_decode(self, seconds: float) -> None:
        self._decode.observe(seconds)

    def observe_kv_transfer(self, seconds: float, nbytes: int, transport: str, exposed_s: float | None = None) -> None:
        """`seconds`: the whole transfer; `exposed_s`: the part of it after prefill ended (all of it when the
        KV moved in one piece)."""
        self._kv_seconds.labels(*self.labels, transport).observe(seconds)
        self._kv_exposed.labels(*self.labels, transport).observe(seconds if exposed_s is None else exposed_s)
        self._kv_bytes.labels(*self.labels, transport).observe(nbytes)

    def record_request(
        self, *, ok: bool, ttft_s: float | None = None, e2e_s: float | None = None, output_tokens: int = 0
    ) -> None:
        """Exactly once per request that should count towards the SLO, whatever became of it: TTFT, TPOT
        and E2E histograms, and the SLO window. `ok=False` or no first token (failed, or rejected for
        load) is a miss on every target."""
        tpot_s = time_per_output_token(ttft_s, e2e_s, output_tokens)
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        if tpot_s is not None:
            self._tpot.observe(tpot_s)
        if e2e_s is not None:
            self._e2e.observe(e2e_s)
        if self.slo is not None:
            self.slo.record(ttft_s, tpot_s, ok=ok)

    # ---- state

    def set_kv_cache_usage(self, ratio: float) -> None:
        self._kv_usage.set(ratio)

    def set_running(self, n: int) -> None:
        self._running.set(n)

    def set_waiting(self, n: int) -> None:
        self._waiting.set(n)

    def set_kv_leases(self, state: str, n: int) -> None:
        self._kv_leases.labels(*self.labels, state).set(n)

    def set_kv_lease_ages(self, oldest_s: float, num_expired: int) -> None:
        """`num_expired` is the engine's running count; the counter takes its increase."""
        self._kv_lease_oldest.set(oldest_s)
        if num_expired > self._num_expired_leases:
            self._kv_leases_expired.inc(num_expired - self._num_expired_leases)
            self._num_expired_leases = num_expired

    def watch_redis(self, probe: RedisHealth) -> None:
        """`pdserve_redis_up` from `probe` at every scrape (absent until its first probe)."""
        self.registry.register(RedisUpCollector(probe, self.labels))

    # ---- counts

    def add_prefix_cache_hit_tokens(self, n: int, source: str = "local") -> None:
        self._prefix_hits.labels(*self.labels, source).inc(n)

    def add_prompt_tokens(self, n: int) -> None:
        self._prompt_tokens.inc(n)

    def add_generation_tokens(self, n: int) -> None:
        self._generation_tokens.inc(n)

    def observe_speculation(self, num_draft_tokens: int, num_accepted_tokens: int, num_verifications: int) -> None:
        """A request's speculative-decoding counts, once when it ends."""
        if not num_verifications:
            return
        self._spec_draft.inc(num_draft_tokens)
        self._spec_accepted.inc(num_accepted_tokens)
        self._spec_verifications.inc(num_verifications)
        totals = self._spec_totals
        for i, n in enumerate((num_draft_tokens, num_accepted_tokens, num_verifications)):
            totals[i] += n
        self._spec_acceptance.set(totals[1] / totals[0] if totals[0] else 0.0)
        self._spec_mean_accepted.set(totals[1] / totals[2])

    def count_decision(self, decision: str, reason: str, n: int = 1) -> None:
        self._decisions.labels(*self.labels, decision, reason).inc(n)

    def count_fallback(self, reason: str) -> None:
        self._fallbacks.labels(*self.labels, reason).inc()

    def count_rejection(self, reason: str) -> None:
        self._rejections.labels(*self.labels, reason).inc()

    # ---- export

    def snapshot(self) -> Snapshot:
        return snapshot_of(self.registry)

    def render(self, others: Iterable[Snapshot] = ()) -> bytes:
        """This replica's metrics merged with `others` (worker snapshots): Prometheus text, CONTENT_TYPE."""
        return render([self.snapshot(), *others])
