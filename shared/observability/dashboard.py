"""The SLA dashboard's tiles: metric snapshots (pdserve.observability.metrics_snapshot) -> values judged
against thresholds. Pure: the caller keeps the readings and gives the clock.

Latency percentiles and rates are over a window: the increase of each counter and histogram series
between a kept earlier `Reading` (the base) and now, per series (a series whose value went down was
reset: its whole value counts), then summed. A series labelled with a replica the base had not seen at
all is left out, since its whole since-start total would count (a worker whose first snapshot arrives
after the base); one the base lacked of a known replica (a label value seen for the first time) counts
from 0. Gauges (queue depth, KV usage, SLO attainment) and live replicas are current values.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field

from pdserve.observability.metrics_snapshot import Snapshot

OK, BREACH, NO_DATA, INFO = "ok", "breach", "no_data", "info"  # INFO: a rate, shown with no threshold

TTFT = "pdserve_time_to_first_token_seconds"
TPOT = "pdserve_time_per_output_token_seconds"
E2E = "pdserve_e2e_request_latency_seconds"
GENERATION_TOKENS = "pdserve_generation_tokens"
REQUESTS = "pdserve_router_requests"
DECISIONS = "pdserve_disaggregation_decisions"
FALLBACKS = "pdserve_fallbacks"
WAITING = "pdserve_requests_waiting"
KV_USAGE = "pdserve_kv_cache_usage_ratio"
ATTAINMENT = "pdserve_slo_attainment"
WINDOWED = frozenset({TTFT, TPOT, E2E, GENERATION_TOKENS, REQUESTS, DECISIONS, FALLBACKS})

GENERATE_ENDPOINTS = frozenset({"chat", "completions", "grpc_generate"})
# the server's doing: load shedding, server errors, a stream that broke after its 200
ERROR_STATUSES = frozenset({"429", "error_after_first_token"})
ITL_NOTE = "ITL is not measured separately: this is TPOT, each request's mean gap between tokens"

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]  # (sample name, sorted labels)


@dataclass(frozen=True)
class Thresholds:
    ttft_s: float
    tpot_s: float
    e2e_s: float | None  # None: what a request of the window's mean length takes at the TTFT and TPOT SLOs
    min_slo_attainment: float
    max_kv_usage: float  # breach at or above
    max_error_rate: float  # breach at or above
    max_fallback_rate: float  # breach at or above
    max_waiting_per_replica: int
    min_live_replicas: int


@dataclass(frozen=True)
class Tile:
    key: str
    label: str
    value: float | None
    unit: str  # "s", "ratio", "per_s", "count"
    status: str
    threshold: float | None = None
    op: str = ""  # value `op` threshold is OK: "<=", "<" or ">="
    count: float | None = None  # what the value is over (requests, decisions, replicas reporting) ...
    count_of: str = ""  # ... and its name
    note: str = ""
    detail: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Reading:
    at: float  # seconds on the caller's clock
    series: dict[SeriesKey, float]  # the windowed families' samples, cumulative

    @property
    def replicas(self) -> frozenset[str]:
        return frozenset(dict(labels).get("replica", "") for _, labels in self.series)


def family_samples(snapshots: Iterable[Snapshot], names: Iterable[str]) -> Iterable[tuple[str, dict, float]]:
    """(sample name, labels, value) of every sample of the named families."""
    wanted = frozenset(names)
    for snapshot in snapshots:
        for family in snapshot.get("families", ()):
            if family["name"] in wanted:
                yield from ((name, labels, value) for name, labels, value in family["samples"])


def reading(at: float, snapshots: Iterable[Snapshot]) -> Reading:
    series: dict[SeriesKey, float] = {}
    for name, labels, value in family_samples(snapshots, WINDOWED):
        key = (name, tuple(sorted(labels.items())))
        series[key] = series.get(key, 0.0) + value
    return Reading(at, series)


def increase(now: Reading, base: Reading) -> dict[SeriesKey, float]:
    known = base.replicas | {""}  # "": the router's own series without a replica label
    out = {}
    for key, value in now.series.items():
        if dict(key[1]).get("replica", "") not in known:
            continue
        before = base.series.get(key, 0.0)
        out[key] = value - before if value >= before else value
    return out


def total(inc: Mapping[SeriesKey, float], sample: str, **match: str | frozenset[str]) -> float:
    """Sum of the `sample` series whose labels match (a str: equal; a frozenset: one of)."""
    out = 0.0
    for (name, labels), value in inc.items():
        if name == sample and all(_matches(dict(labels).get(k), v) for k, v in match.items()):
            out += value
    return out


def _matches(value: str | None, want: str | frozenset[str]) -> bool:
    return value == want if isinstance(want, str) else value in want


def buckets(inc: Mapping[SeriesKey, float], histogram: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a histogram's window, summed over its series, by bound."""
    by_le: dict[float, float] = {}
    for (name, labels), value in inc.items():
        if name == histogram + "_bucket":
            le = float(dict(labels)["le"])
            by_le[le] = by_le.get(le, 0.0) + value
    return sorted(by_le.items())


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile: linear within the bucket holding rank q * count (from 0 in the
    first); in the +Inf bucket, the largest finite bound. None for an empty histogram."""
    if not cumulative or cumulative[-1][1] <= 0:
        return None
    rank = q * cumulative[-1][1]
    lower, below = 0.0, 0.0
    for le, count in cumulative:
        if count >= rank and count > below:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def judge(value: float | None, threshold: float | None, op: str) -> str:
    if value is None:
        return NO_DATA
    if threshold is None:
        return INFO
    met = {"<=": value <= threshold, "<": value < threshold, ">=": value >= threshold}[op]
    return OK if met else BREACH


def _tile(key: str, label: str, value: float | None, unit: str, threshold: float | None = None, op: str = "",
          **extra) -> Tile:
    return Tile(key, label, value, unit, judge(value, threshold, op), threshold, op, **extra)


def _by_replica(snapshots: Iterable[Snapshot], family: str, role: str) -> dict[str, float]:
    return {labels.get("replica", ""): value for _, labels, value in family_samples(snapshots, (family,))
            if labels.get("role") == role}


def latency_tiles(inc: Mapping[SeriesKey, float], t: Thresholds) -> list[Tile]:
    ttft, tpot, e2e = (buckets(inc, name) for name in (TTFT, TPOT, E2E))
    num_e2e = e2e[-1][1] if e2e else 0.0
    e2e_s = t.e2e_s
    if e2e_s is None and num_e2e:
        mean_tokens = total(inc, GENERATION_TOKENS + "_total", role="router") / num_e2e
        e2e_s = t.ttft_s + t.tpot_s * max(mean_tokens - 1.0, 0.0)
    e2e_note = "" if t.e2e_s is not None else "SLA: TTFT SLO + TPOT SLO x (mean output tokens - 1)"

    def count(cumulative: list[tuple[float, float]]) -> float:
        return cumulative[-1][1] if cumulative else 0.0

    req = "requests"
    return [
        _tile("ttft_p50", "TTFT p50", histogram_quantile(0.5, ttft), "s", t.ttft_s, "<=", count=count(ttft),
              count_of=req),
        _tile("ttft_p95", "TTFT p95", histogram_quantile(0.95, ttft), "s", t.ttft_s, "<=", count=count(ttft),
              count_of=req),
        _tile("tpot_p50", "TPOT p50 (ITL)", histogram_quantile(0.5, tpot), "s", t.tpot_s, "<=", count=count(tpot),
              count_of=req, note=ITL_NOTE),
        _tile("e2e_p50", "E2E p50", histogram_quantile(0.5, e2e), "s", e2e_s, "<=", count=num_e2e, count_of=req,
              note=e2e_note),
        _tile("e2e_p95", "E2E p95", histogram_quantile(0.95, e2e), "s", e2e_s, "<=", count=num_e2e, count_of=req,
              note=e2e_note),
    ]


def traffic_tiles(inc: Mapping[SeriesKey, float], span_s: float, t: Thresholds) -> list[Tile]:
    def per_s(n: float) -> float | None:
        return n / span_s if span_s > 0 else None

    requests = total(inc, REQUESTS + "_total", endpoint=GENERATE_ENDPOINTS)
    errors = sum(v for (name, labels), v in inc.items() if name == REQUESTS + "_total" and _is_error(dict(labels)))
    disaggregated = total(inc, DECISIONS + "_total", decision="disaggregate")
    fallbacks = sum(v for (name, labels), v in inc.items()
                    if name == FALLBACKS + "_total" and not dict(labels).get("reason", "").startswith("prefix_"))
    tokens = total(inc, GENERATION_TOKENS + "_total", role="router")
    return [
        _tile("output_tokens_per_s", "Output tokens/s", per_s(tokens), "per_s", count=tokens, count_of="tokens"),
        _tile("request_rate", "Request rate", per_s(requests), "per_s", count=requests, count_of="requests"),
        _tile("error_rate", "Error rate", errors / requests if requests else None, "ratio", t.max_error_rate, "<",
              count=requests, count_of="requests", note="429, 5xx, streams broken after their 200"),
        _tile("fallback_rate", "Handoff fallbacks", fallbacks / disaggregated if disaggregated else None,
              "ratio", t.max_fallback_rate, "<", count=disaggregated, count_of="handoffs",
              note="fell back to a local prefill"),
    ]


def _is_error(labels: dict[str, str]) -> bool:
    status = labels.get("status", "")
    return labels.get("endpoint") in GENERATE_ENDPOINTS and (status in ERROR_STATUSES or status.startswith("5"))


def state_tiles(snapshots: list[Snapshot], live: Mapping[str, int | None], t: Thresholds) -> list[Tile]:
    """`live`: role -> live replicas (None: not polled yet), for each role the mode needs."""
    out = []
    attainment = {labels.get("slo"): value for _, labels, value in family_samples(snapshots, (ATTAINMENT,))
                  if labels.get("role") == "router"}
    out.append(_tile("slo_attainment", "SLO attainment", attainment.get("both"), "ratio", t.min_slo_attainment,
                     ">=", detail={k: v for k, v in attainment.items() if k in ("ttft", "tpot")},
                     note="both SLOs met; 429/503 count as misses"))
    for role in live:
        waiting = _by_replica(snapshots, WAITING, role)
        out.append(_tile(f"queue_depth:{role}", f"Queue depth ({role})", sum(waiting.values()) if waiting else None,
                         "count", t.max_waiting_per_replica * len(waiting) if waiting else None, "<=",
                         count=len(waiting), count_of="replicas", detail=waiting))
    for role in live:
        usage = _by_replica(snapshots, KV_USAGE, role)
        out.append(_tile(f"kv_usage:{role}", f"KV usage ({role})", max(usage.values()) if usage else None,
                         "ratio", t.max_kv_usage, "<", count=len(usage), count_of="replicas", detail=usage,
                         note="the fullest replica's"))
    for role, n in live.items():
        out.append(_tile(f"health:{role}", f"Live {role} replicas", None if n is None else float(n), "count",
                         float(t.min_live_replicas), ">="))
    return out


def tiles(
    now: Reading, base: Reading | None, snapshots: list[Snapshot], live: Mapping[str, int | None], t: Thresholds,
) -> list[Tile]:
    """Every tile: latencies and rates over [base.at, now.at] (none without a base), state from `snapshots`."""
    inc = increase(now, base) if base is not None else {}
    span_s = now.at - base.at if base is not None else 0.0
    return [*latency_tiles(inc, t), *traffic_tiles(inc, span_s, t), *state_tiles(snapshots, live, t)]


def tile_dicts(found: Iterable[Tile]) -> list[dict]:
    return [asdict(tile) for tile in found]
