"""The SLA dashboard's tiles from real ServingMetrics snapshots (a router's registry and workers'), table by
table, and the router's keeping of readings (window, base, worker refresh rate)."""

from __future__ import annotations

import asyncio
import math

import pytest
from pdserve.observability import dashboard as d
from pdserve.observability.metrics import ServingMetrics
from pdserve.observability.metrics_snapshot import snapshot_of
from pdserve.observability.slo import SloWindow
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dashboard import REFRESH_S, RouterDashboard, thresholds
from prometheus_client import Counter

T = d.Thresholds(ttft_s=2.0, tpot_s=0.2, e2e_s=None, min_slo_attainment=0.9, max_kv_usage=0.9,
                 max_error_rate=0.01, max_fallback_rate=0.01, max_waiting_per_replica=8, min_live_replicas=1)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Router:
    """A router's real metrics: ServingMetrics with an SLO window, and its requests counter."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or Clock()
        self.metrics = ServingMetrics("router", "router-1", "tiny", slo=SloWindow(60, 2.0, 0.2, clock=self.clock))
        self.requests = Counter("pdserve_router_requests", "", ["endpoint", "status"], registry=self.metrics.registry)

    def serve(self, ttft: float, e2e: float, tokens: int, status: str = "200", endpoint: str = "chat") -> None:
        self.metrics.add_generation_tokens(tokens)
        self.metrics.record_request(ok=status == "200", ttft_s=ttft, e2e_s=e2e, output_tokens=tokens)
        self.requests.labels(endpoint, status).inc()

    def snapshot(self) -> dict:
        return snapshot_of(self.metrics.registry)


def worker(role: str, replica: str, *, waiting: int = 0, usage: float = 0.0, fallbacks: dict | None = None) -> dict:
    m = ServingMetrics(role, replica, "tiny")
    m.set_waiting(waiting)
    m.set_kv_cache_usage(usage)
    for reason, n in (fallbacks or {}).items():
        for _ in range(n):
            m.count_fallback(reason)
    return m.snapshot()


def by_key(found: list[d.Tile]) -> dict[str, d.Tile]:
    return {t.key: t for t in found}


def window(router: Router, before: list[dict], after: list[dict], live=None, t=T, span=10.0) -> dict[str, d.Tile]:
    """Tiles over [0, span] between snapshots taken before and after some traffic."""
    base = d.reading(0.0, before)
    now = d.reading(span, after)
    return by_key(d.tiles(now, base, after, live or {"prefill": 1, "decode": 1}, t))


@pytest.mark.parametrize("q, cumulative, expected", [
    (0.5, [(0.1, 0), (0.2, 10), (math.inf, 10)], 0.15),  # linear inside (0.1, 0.2]
    (0.5, [(0.1, 4), (math.inf, 4)], 0.05),  # the first bucket starts at 0
    (0.95, [(0.1, 0), (0.2, 1), (math.inf, 2)], 0.2),  # rank in +Inf: the largest finite bound
    (0.5, [(0.1, 0), (math.inf, 0)], None),  # nothing observed
    (0.5, [], None),
    (1.0, [(0.1, 1), (0.5, 3), (math.inf, 3)], 0.5),
])
def test_histogram_quantile_as_prometheus_computes_it(q, cumulative, expected):
    assert d.histogram_quantile(q, cumulative) == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize("value, threshold, op, status", [
    (None, 2.0, "<=", d.NO_DATA), (1.0, None, "", d.INFO), (2.0, 2.0, "<=", d.OK), (2.01, 2.0, "<=", d.BREACH),
    (0.9, 0.9, "<", d.BREACH), (0.0, 0.01, "<", d.OK), (0.9, 0.9, ">=", d.OK), (0.89, 0.9, ">=", d.BREACH),
    (0.0, 1.0, ">=", d.BREACH),
])
def test_judge(value, threshold, op, status):
    assert d.judge(value, threshold, op) == status


def test_latency_percentiles_cover_only_the_window():
    router = Router()
    for _ in range(50):  # before the window: slow requests that must not count
        router.serve(ttft=8.0, e2e=30.0, tokens=16)
    before = [router.snapshot()]
    for _ in range(10):
        router.serve(ttft=0.12, e2e=1.62, tokens=16)  # TPOT 0.1
    tiles = window(router, before, [router.snapshot()])
    assert tiles["ttft_p50"].count == 10 and tiles["e2e_p95"].count == 10
    assert 0.1 < tiles["ttft_p50"].value <= 0.15 and tiles["ttft_p50"].status == d.OK
    assert 0.1 < tiles["ttft_p95"].value <= 0.15
    assert 0.075 < tiles["tpot_p50"].value <= 0.1 and "ITL is not measured separately" in tiles["tpot_p50"].note
    assert 1.0 < tiles["e2e_p50"].value <= 2.0
    # no E2E SLO set: TTFT SLO + TPOT SLO x (16 - 1)
    assert tiles["e2e_p50"].threshold == pytest.approx(2.0 + 0.2 * 15) and tiles["e2e_p50"].status == d.OK


def test_latencies_past_the_slo_breach():
    router = Router()
    before = [router.snapshot()]
    for i in range(20):
        router.serve(ttft=0.1 if i < 15 else 4.0, e2e=4.1 if i < 15 else 40.0, tokens=2)
    tiles = window(router, before, [router.snapshot()])
    assert tiles["ttft_p50"].status == d.OK and tiles["ttft_p95"].status == d.BREACH
    assert tiles["tpot_p50"].status == d.BREACH  # 4.0 s between the two tokens
    assert tiles["e2e_p95"].status == d.BREACH
    e2e_set = d.Thresholds(**{**T.__dict__, "e2e_s": 60.0})
    assert window(router, before, [router.snapshot()], t=e2e_set)["e2e_p95"].status == d.OK


def test_rates_errors_and_their_rules():
    router = Router()
    router.serve(0.1, 1.0, 10)
    before = [router.snapshot()]
    for status in ["200"] * 95 + ["429", "500", "error_after_first_token"]:
        router.serve(0.1, 1.0, 10, status=status)
    router.serve(0.1, 1.0, 10, status="400")  # the client's error: counted, not an error
    router.serve(0.1, 1.0, 10, status="client_disconnected")
    router.requests.labels("models", "500").inc()  # not a generate request
    tiles = window(router, before, [router.snapshot()], span=20.0)
    assert tiles["request_rate"].value == pytest.approx(100 / 20) and tiles["request_rate"].status == d.INFO
    assert tiles["output_tokens_per_s"].value == pytest.approx(100 * 10 / 20)
    assert tiles["error_rate"].value == pytest.approx(3 / 100) and tiles["error_rate"].status == d.BREACH
    assert window(router, before, [router.snapshot()], t=d.Thresholds(**{**T.__dict__, "max_error_rate": 0.05}))[
        "error_rate"].status == d.OK


def test_no_base_or_no_traffic_is_no_data():
    router = Router()
    snap = [router.snapshot()]
    tiles = by_key(d.tiles(d.reading(5.0, snap), None, snap, {"decode": 1}, T))
    for key in ("ttft_p50", "ttft_p95", "tpot_p50", "e2e_p50", "e2e_p95", "output_tokens_per_s", "request_rate",
                "error_rate", "fallback_rate", "slo_attainment", "queue_depth:decode", "kv_usage:decode"):
        assert tiles[key].status == d.NO_DATA and tiles[key].value is None, key
    assert tiles["health:decode"].status == d.OK


def test_fallback_rate_is_handoff_fallbacks_over_decisions_to_disaggregate():
    router = Router()
    decode = ServingMetrics("decode", "decode-1", "tiny")
    before = [router.snapshot(), decode.snapshot()]
    router.metrics.count_decision("disaggregate", "prompt_length", 40)
    router.metrics.count_decision("skip", "short_prompt", 100)
    router.metrics.count_fallback("prefill_unavailable")
    decode.count_fallback("transfer_failed")
    decode.count_fallback("prefix_redis_down")  # a Redis-tier prefix pull, not a handoff
    tiles = window(router, before, [router.snapshot(), decode.snapshot()])
    assert tiles["fallback_rate"].value == pytest.approx(2 / 40) and tiles["fallback_rate"].count == 40
    assert tiles["fallback_rate"].status == d.BREACH


def test_a_replica_the_base_never_saw_is_left_out_and_a_reset_counts_from_zero():
    router = Router()
    old = ServingMetrics("decode", "decode-old", "tiny")
    for _ in range(5):
        old.count_fallback("transfer_failed")
    before = [router.snapshot(), old.snapshot()]
    router.metrics.count_decision("disaggregate", "prompt_length", 10)
    late = worker("decode", "decode-late", fallbacks={"transfer_failed": 7})  # since-start total: not the window's
    restarted = ServingMetrics("decode", "decode-old", "tiny")  # same id, counter back from 5 to 1
    restarted.count_fallback("transfer_failed")
    tiles = window(router, before, [router.snapshot(), restarted.snapshot(), late])
    assert tiles["fallback_rate"].value == pytest.approx(1 / 10)


def test_queue_kv_attainment_and_health_are_current_values():
    clock = Clock()
    router = Router(clock)
    for i in range(10):
        router.serve(ttft=0.1 if i < 8 else 5.0, e2e=1.0 if i < 8 else 6.0, tokens=8)
    workers = [worker("prefill", "p1", waiting=3, usage=0.2), worker("decode", "d1", waiting=10, usage=0.95),
               worker("decode", "d2", waiting=2, usage=0.3)]
    snaps = [router.snapshot(), *workers]
    tiles = window(router, snaps, snaps, live={"prefill": 1, "decode": 0})
    att = tiles["slo_attainment"]
    assert att.value == pytest.approx(0.8) and att.status == d.BREACH and att.detail == {"ttft": 0.8, "tpot": 1.0}
    assert (tiles["queue_depth:prefill"].value, tiles["queue_depth:prefill"].status) == (3, d.OK)
    q = tiles["queue_depth:decode"]
    assert (q.value, q.threshold, q.count, q.status) == (12, 16, 2, d.OK)
    assert (tiles["kv_usage:prefill"].value, tiles["kv_usage:prefill"].status) == (pytest.approx(0.2), d.OK)
    kv = tiles["kv_usage:decode"]
    assert kv.value == pytest.approx(0.95) and kv.status == d.BREACH and kv.detail == {"d1": 0.95, "d2": 0.3}
    assert (tiles["health:prefill"].value, tiles["health:prefill"].status) == (1, d.OK)
    assert (tiles["health:decode"].value, tiles["health:decode"].status) == (0, d.BREACH)
    clock.now += 61  # the SLO window empties: attainment is absent, not 0
    assert window(router, snaps, [router.snapshot()])["slo_attainment"].status == d.NO_DATA


def test_health_before_the_first_poll_is_no_data_and_colocated_has_no_prefill_tiles():
    router = Router()
    snap = [router.snapshot()]
    tiles = by_key(d.tiles(d.reading(1.0, snap), d.reading(0.0, snap), snap, {"decode": None}, T))
    assert tiles["health:decode"].status == d.NO_DATA
    assert not [k for k in tiles if "prefill" in k]


def test_tiles_are_plain_json_data():
    import json

    router = Router()
    router.serve(0.1, 1.0, 4)
    snap = [router.snapshot()]
    dumped = json.loads(json.dumps(d.tile_dicts(d.tiles(d.reading(1.0, snap), d.reading(0.0, []), snap,
                                                        {"decode": 1}, T))))
    fields = {"key", "label", "value", "unit", "status", "threshold", "op", "count", "count_of", "note", "detail"}
    assert fields <= set(dumped[0])


# ---- the router's keeping: services/router/dashboard.py


class Poller:
    """The two things RouterDashboard reads of ReplicaStatsPoller (whose real polling needs Ray actors)."""

    def __init__(self, live: dict[str, list[str]]) -> None:
        self.deployments = tuple(live)
        self.live = live
        self.polled = asyncio.Event()
        self.polled.set()

    def start(self) -> None:
        pass

    def snapshots(self, role: str) -> list:
        from types import SimpleNamespace

        return [SimpleNamespace(replica=r) for r in self.live[role]]


def test_router_dashboard_keeps_a_window_of_readings_and_refreshes_workers_at_most_every_few_seconds():
    config = RouterConfig(slo_window_s=10.0, dashboard_worker_refresh_s=2.0)
    assert thresholds(config).ttft_s == config.slo_ttft_s and thresholds(config).max_kv_usage == 0.9
    clock = Clock(100.0)
    router = Router(clock)
    cache: dict[str, tuple[float, dict]] = {}
    refreshes: list[float] = []

    async def refresh() -> None:
        refreshes.append(clock.now)
        cache["d1"] = (clock.now, worker("decode", "d1", waiting=4, usage=0.5))
        cache["gone"] = (clock.now, worker("decode", "gone", waiting=50, usage=1.0))  # not alive: left out

    poller = Poller({"prefill": [], "decode": ["d1"]})
    board = RouterDashboard(config, router.metrics.registry, cache, poller, refresh, clock=clock)

    async def polls() -> list[dict]:
        out = []
        for _ in range(30):  # 10 polls a second for 3 s
            out.append(board.data())
            await asyncio.sleep(0)
            clock.now += 0.1
            router.serve(0.1, 1.0, 4)
        return out

    first, *_, last = asyncio.run(polls())
    assert first["window"]["seconds"] == 0 and by_key_dict(first)["request_rate"]["status"] == d.NO_DATA
    assert len(refreshes) == 2 and refreshes[1] - refreshes[0] >= 2.0 - 1e-9  # not one per poll
    assert len(board.readings) <= 3.0 / REFRESH_S + 1
    tiles = by_key_dict(last)
    assert last["window"]["seconds"] == pytest.approx(2.9) and tiles["request_rate"]["value"] == pytest.approx(10)
    assert tiles["queue_depth:decode"]["value"] == 4 and tiles["kv_usage:decode"]["value"] == 0.5
    assert tiles["health:prefill"]["status"] == d.BREACH and tiles["health:decode"]["value"] == 1
    clock.now += 30  # nobody polled for longer than the window: no base, no rates
    assert asyncio.run(_data(board))["window"]["seconds"] == 0


async def _data(board: RouterDashboard) -> dict:
    return board.data()


def by_key_dict(data: dict) -> dict[str, dict]:
    return {t["key"]: t for t in data["tiles"]}


@pytest.mark.parametrize("field, value", [
    ("dashboard_min_slo_attainment", 1.5), ("dashboard_max_kv_usage", 0), ("dashboard_max_error_rate", -0.1),
    ("dashboard_max_waiting_per_replica", -1), ("dashboard_min_live_replicas", 0), ("dashboard_e2e_slo_s", 0),
    ("dashboard_worker_refresh_s", 0.1),
])
def test_bad_thresholds_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})
