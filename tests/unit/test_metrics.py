"""ServingMetrics: per-replica Prometheus metrics, plain-data snapshots merged by the router, SLO windows."""

from __future__ import annotations

import json
import math
import pickle

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from pdserve.observability.metrics import CONTENT_TYPE, ServingMetrics
from pdserve.observability.metrics_snapshot import merge, render
from pdserve.observability.slo import SloAttainment, SloWindow, time_per_output_token

DECODE0 = {"role": "decode", "replica": "decode-0", "model": "tiny"}


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def parse(text: bytes) -> dict:
    families = {f.name: f for f in text_string_to_metric_families(text.decode())}
    assert len(families) == len(list(text_string_to_metric_families(text.decode()))), "family split in two"
    return families


def value(families: dict, family: str, sample: str, **labels: str) -> float:
    found = [s.value for s in families[family].samples if s.name == sample and s.labels == labels]
    assert len(found) == 1, f"{sample}{labels}: {len(found)} samples"
    return found[0]


def buckets(families: dict, family: str, **labels: str) -> dict[float, float]:
    return {
        float(s.labels["le"]): s.value
        for s in families[family].samples
        if s.name == family + "_bucket" and {k: v for k, v in s.labels.items() if k != "le"} == labels
    }


def test_histogram_buckets_count_and_sum():
    m = ServingMetrics(**DECODE0)
    for seconds in (0.02, 0.2, 5.0):
        m.observe_ttft(seconds)
    fam = parse(m.render())
    name = "pdserve_time_to_first_token_seconds"
    assert fam[name].type == "histogram"
    assert value(fam, name, name + "_count", **DECODE0) == 3
    assert value(fam, name, name + "_sum", **DECODE0) == pytest.approx(5.22)
    got = buckets(fam, name, **DECODE0)
    assert [got[le] for le in (0.01, 0.025, 0.15, 0.2, 3.0, 5.0, math.inf)] == [0, 1, 1, 2, 2, 3, 3]
    assert (
        value(
            fam,
            "pdserve_time_per_output_token_seconds",
            "pdserve_time_per_output_token_seconds_count",
            **DECODE0,
        )
        == 0
    )


def test_every_latency_histogram_has_its_name():
    m = ServingMetrics(**DECODE0)
    m.observe_tpot(0.01)
    m.observe_e2e(2.0)
    m.observe_queue(0.05)
    m.observe_prefill(0.3)
    m.observe_decode(1.5)
    fam = parse(m.render())
    for name, total in [
        ("pdserve_time_per_output_token_seconds", 0.01),
        ("pdserve_e2e_request_latency_seconds", 2.0),
        ("pdserve_request_queue_seconds", 0.05),
        ("pdserve_request_prefill_seconds", 0.3),
        ("pdserve_request_decode_seconds", 1.5),
    ]:
        assert value(fam, name, name + "_count", **DECODE0) == 1
        assert value(fam, name, name + "_sum", **DECODE0) == pytest.approx(total)


def test_kv_transfer_is_labelled_by_transport():
    m = ServingMetrics(role="prefill", replica="prefill-1", model="tiny")
    m.observe_kv_transfer(0.004, 3 << 20, "ucx")
    m.observe_kv_transfer(0.020, 100 << 20, "ucx")
    m.observe_kv_transfer(0.3, 1 << 16, "redis")
    fam = parse(m.render())
    ucx = {"role": "prefill", "replica": "prefill-1", "model": "tiny", "transport": "ucx"}
    assert value(fam, "pdserve_kv_transfer_seconds", "pdserve_kv_transfer_seconds_count", **ucx) == 2
    assert value(fam, "pdserve_kv_transfer_bytes", "pdserve_kv_transfer_bytes_sum", **ucx) == 103 << 20
    assert buckets(fam, "pdserve_kv_transfer_bytes", **ucx)[4 << 20] == 1
    assert buckets(fam, "pdserve_kv_transfer_bytes", **ucx)[math.inf] == 2
    assert buckets(fam, "pdserve_kv_transfer_bytes", **{**ucx, "transport": "redis"})[64 << 10] == 1


def test_counters_and_gauges():
    m = ServingMetrics(role="router", replica="router-0", model="tiny")
    labels = {"role": "router", "replica": "router-0", "model": "tiny"}
    m.add_prompt_tokens(5)
    m.add_prompt_tokens(7)
    m.add_generation_tokens(3)
    m.add_prefix_cache_hit_tokens(16)
    m.count_decision("disaggregate", "long_prompt", n=2)
    m.count_decision("skip", "short_prompt")
    m.count_fallback("prefill_timeout")
    m.count_rejection("overloaded")
    m.count_rejection("overloaded")
    m.set_kv_cache_usage(0.75)
    m.set_running(4)
    m.set_waiting(2)
    m.set_running(3)
    fam = parse(m.render())
    assert fam["pdserve_prompt_tokens"].type == "counter"
    assert value(fam, "pdserve_prompt_tokens", "pdserve_prompt_tokens_total", **labels) == 12
    assert value(fam, "pdserve_generation_tokens", "pdserve_generation_tokens_total", **labels) == 3
    assert (
        value(fam, "pdserve_prefix_cache_hit_tokens", "pdserve_prefix_cache_hit_tokens_total", **labels,
              source="local") == 16
    )
    assert value(fam, "pdserve_prefix_cache_hit_tokens", "pdserve_prefix_cache_hit_tokens_total", **labels,
                 source="redis") == 0
    decisions = "pdserve_disaggregation_decisions"
    assert (
        value(fam, decisions, decisions + "_total", decision="disaggregate", reason="long_prompt", **labels)
        == 2
    )
    assert value(fam, decisions, decisions + "_total", decision="skip", reason="short_prompt", **labels) == 1
    assert value(fam, "pdserve_fallbacks", "pdserve_fallbacks_total", reason="prefill_timeout", **labels) == 1
    assert value(fam, "pdserve_rejections", "pdserve_rejections_total", reason="overloaded", **labels) == 2
    assert value(fam, "pdserve_kv_cache_usage_ratio", "pdserve_kv_cache_usage_ratio", **labels) == 0.75
    assert value(fam, "pdserve_requests_running", "pdserve_requests_running", **labels) == 3
    assert value(fam, "pdserve_requests_waiting", "pdserve_requests_waiting", **labels) == 2


def test_router_renders_every_replica_once_per_family():
    router = ServingMetrics(role="router", replica="router-0", model="tiny")
    workers = [
        ServingMetrics(role="prefill", replica="prefill-0", model="tiny"),
        ServingMetrics(role="decode", replica="decode-0", model="tiny"),
        ServingMetrics(role="decode", replica="decode-1", model="tiny"),
    ]
    router.observe_ttft(0.1)
    for i, w in enumerate(workers):
        w.add_generation_tokens(10 * (i + 1))
        w.observe_ttft(0.05)
        w.set_running(i)
    text = router.render([w.snapshot() for w in workers])
    assert text.count(b"# TYPE pdserve_time_to_first_token_seconds histogram") == 1
    fam = parse(text)
    ttft = "pdserve_time_to_first_token_seconds"
    by_replica = {s.labels["replica"]: s.value for s in fam[ttft].samples if s.name == ttft + "_count"}
    assert by_replica == {"router-0": 1, "prefill-0": 1, "decode-0": 1, "decode-1": 1}
    tokens = {
        s.labels["replica"]: s.value
        for s in fam["pdserve_generation_tokens"].samples
        if s.name == "pdserve_generation_tokens_total"
    }
    assert tokens == {"router-0": 0, "prefill-0": 10, "decode-0": 20, "decode-1": 30}
    assert (
        value(
            fam,
            "pdserve_requests_running",
            "pdserve_requests_running",
            role="decode",
            replica="decode-1",
            model="tiny",
        )
        == 2
    )
    assert CONTENT_TYPE.startswith("text/plain")


def test_snapshot_is_plain_data_without_created_samples():
    m = ServingMetrics(**DECODE0)
    m.observe_e2e(1.0)
    m.count_fallback("x")
    snap = m.snapshot()
    assert json.loads(json.dumps(snap)) == snap
    assert pickle.loads(pickle.dumps(snap)) == snap
    names = [s[0] for f in snap["families"] for s in f["samples"]]
    assert names and not [n for n in names if n.endswith("_created")]
    assert b"_created" not in m.render()


def test_duplicate_series_are_summed_except_gauges():
    a, b = ServingMetrics(**DECODE0), ServingMetrics(**DECODE0)
    a.add_generation_tokens(4)
    b.add_generation_tokens(6)
    a.observe_ttft(0.1)
    b.observe_ttft(0.1)
    a.set_waiting(9)
    b.set_waiting(1)
    fam = parse(render([a.snapshot(), b.snapshot()]))
    assert value(fam, "pdserve_generation_tokens", "pdserve_generation_tokens_total", **DECODE0) == 10
    ttft = "pdserve_time_to_first_token_seconds"
    assert buckets(fam, ttft, **DECODE0)[0.1] == 2
    assert value(fam, "pdserve_requests_waiting", "pdserve_requests_waiting", **DECODE0) == 1


def test_foreign_snapshots_are_skipped():
    m = ServingMetrics(**DECODE0)
    m.add_prompt_tokens(1)
    wrong_version = {**m.snapshot(), "version": 99}
    wrong_type = {
        "version": 1,
        "families": [
            {
                "name": "pdserve_prompt_tokens",
                "type": "gauge",
                "help": "",
                "samples": [["pdserve_prompt_tokens", {}, 5.0]],
            }
        ],
    }
    families = {f.name: f for f in merge([m.snapshot(), wrong_version, wrong_type])}
    assert [s.value for s in families["pdserve_prompt_tokens"].samples] == [1.0]


def test_registries_are_private():
    a, b = ServingMetrics(**DECODE0), ServingMetrics(**DECODE0)  # same names twice: fine, no shared registry
    a.add_prompt_tokens(1)
    assert b.snapshot() != a.snapshot()
    assert not [f for f in REGISTRY.collect() if f.name.startswith("pdserve_")]


def test_label_values_are_escaped():
    m = ServingMetrics(role="decode", replica='r"1\\x', model="org/model\nv2")
    m.add_prompt_tokens(2)
    fam = parse(m.render())
    assert (
        value(
            fam,
            "pdserve_prompt_tokens",
            "pdserve_prompt_tokens_total",
            role="decode",
            replica='r"1\\x',
            model="org/model\nv2",
        )
        == 2
    )


# ---- SLO window


@pytest.mark.parametrize(
    "ttft,e2e,n,expected",
    [
        (0.1, 1.1, 11, 0.1),
        (0.5, 0.5, 2, 0.0),
        (0.2, 0.3, 1, None),
        (0.2, 0.3, 0, None),
        (None, 1.0, 5, None),
        (0.1, None, 5, None),
    ],
)
def test_time_per_output_token(ttft, e2e, n, expected):
    result = time_per_output_token(ttft, e2e, n)
    assert result == (pytest.approx(expected) if expected is not None else None)


def test_slo_attainment_hand_computed():
    window = SloWindow(60.0, ttft_slo_s=0.5, tpot_slo_s=0.05, clock=FakeClock())
    window.record(0.1, 0.01)  # both met
    window.record(0.6, 0.01)  # TTFT missed
    window.record(0.2, 0.1)  # TPOT missed
    window.record(0.5, None)  # one output token, TTFT exactly at target: both met
    window.record_failure()  # no token: both missed
    assert window.attainment() == SloAttainment(requests=5, ttft=3 / 5, tpot=3 / 5, both=2 / 5)


def test_failed_request_with_a_first_token_is_a_miss():
    window = SloWindow(60.0, ttft_slo_s=0.5, tpot_slo_s=0.05, clock=FakeClock())
    window.record(0.1, 0.01, ok=False)
    window.record(None, None)
    assert window.attainment() == SloAttainment(2, 0.0, 0.0, 0.0)


def test_slo_window_expires_old_samples():
    clock = FakeClock(100.0)
    window = SloWindow(10.0, ttft_slo_s=1.0, tpot_slo_s=0.1, clock=clock)
    assert window.attainment() == SloAttainment(0, None, None, None)
    window.record(2.0, 0.01)  # t=100: TTFT miss
    clock.now = 105.0
    window.record(0.5, 0.01)  # t=105: met
    clock.now = 109.999
    assert window.attainment() == SloAttainment(2, 0.5, 1.0, 0.5)
    clock.now = 110.0  # the t=100 sample is exactly window_s old: gone
    assert window.attainment() == SloAttainment(1, 1.0, 1.0, 1.0)
    clock.now = 114.0
    window.record(0.5, 0.5)  # t=114: TPOT miss
    assert window.attainment() == SloAttainment(2, 1.0, 0.5, 0.5)
    clock.now = 124.0
    assert window.attainment() == SloAttainment(0, None, None, None)


@pytest.mark.parametrize("args", [(0, 1, 1), (10, 0, 1), (10, 1, -1)])
def test_slo_window_rejects_non_positive_settings(args):
    with pytest.raises(ValueError):
        SloWindow(*args)


def test_slo_gauges_through_record_request_and_router_render():
    clock = FakeClock()
    router = ServingMetrics(
        role="router",
        replica="router-0",
        model="tiny",
        slo=SloWindow(30.0, ttft_slo_s=0.5, tpot_slo_s=0.05, clock=clock),
    )
    labels = {"role": "router", "replica": "router-0", "model": "tiny"}
    fam = parse(router.render())
    assert "pdserve_slo_attainment" not in fam or not fam["pdserve_slo_attainment"].samples  # empty window
    assert value(fam, "pdserve_slo_window_requests", "pdserve_slo_window_requests", **labels) == 0

    router.record_request(ok=True, ttft_s=0.2, e2e_s=1.2, output_tokens=21)  # tpot 0.05: both met
    router.record_request(ok=True, ttft_s=0.9, e2e_s=1.0, output_tokens=3)  # ttft missed, tpot 0.05 met
    router.record_request(ok=True, ttft_s=0.3, e2e_s=2.3, output_tokens=11)  # tpot 0.2 missed
    router.record_request(ok=False)  # rejected: misses
    fam = parse(router.render([ServingMetrics(**DECODE0).snapshot()]))
    slo = {s.labels["slo"]: s.value for s in fam["pdserve_slo_attainment"].samples}
    assert slo == pytest.approx({"ttft": 2 / 4, "tpot": 2 / 4, "both": 1 / 4})
    assert all(s.labels["replica"] == "router-0" for s in fam["pdserve_slo_attainment"].samples)
    assert value(fam, "pdserve_slo_window_requests", "pdserve_slo_window_requests", **labels) == 4
    assert value(fam, "pdserve_slo_target_seconds", "pdserve_slo_target_seconds", slo="ttft", **labels) == 0.5
    tpot = "pdserve_time_per_output_token_seconds"
    assert value(fam, tpot, tpot + "_count", **labels) == 3
    assert value(fam, tpot, tpot + "_sum", **labels) == pytest.approx(0.05 + 0.05 + 0.2)
    ttft = "pdserve_time_to_first_token_seconds"
    assert value(fam, ttft, ttft + "_count", **labels) == 3
    assert (
        value(
            fam, "pdserve_e2e_request_latency_seconds", "pdserve_e2e_request_latency_seconds_count", **labels
        )
        == 3
    )

    clock.now += 30.0
    fam = parse(router.render())
    assert value(fam, "pdserve_slo_window_requests", "pdserve_slo_window_requests", **labels) == 0
    assert not math.isnan(value(fam, "pdserve_slo_window_seconds", "pdserve_slo_window_seconds", **labels))


def test_lease_age_and_expired_leases():
    m = ServingMetrics(**DECODE0)
    m.set_kv_lease_ages(0.0, 0)
    m.set_kv_lease_ages(12.5, 3)
    m.set_kv_lease_ages(4.0, 3)  # the same running count again adds nothing
    m.set_kv_lease_ages(4.0, 5)
    families = parse(m.render())
    assert value(families, "pdserve_kv_lease_oldest_seconds", "pdserve_kv_lease_oldest_seconds", **DECODE0) == 4.0
    assert value(families, "pdserve_kv_leases_expired", "pdserve_kv_leases_expired_total", **DECODE0) == 5
