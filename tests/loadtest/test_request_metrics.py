"""TTFT, TPOT, ITL, E2E, percentiles and run summaries against hand-computed values."""

from __future__ import annotations

import pytest
from pdserve.loadtest.client import RequestResult
from pdserve.loadtest.metrics import counts, percentile, request_metrics, stats, summarize


def done(chunks: list[float], e2e: float, tokens: int, index: int = 0) -> RequestResult:
    return RequestResult(index, 100, tokens, 0.0, 0.0, "ok", 200, list(chunks), e2e, tokens)


def test_ttft_tpot_itl_e2e_by_hand():
    m = request_metrics(done([0.1, 0.15, 0.25, 0.3], e2e=0.32, tokens=4))
    assert m.ttft_s == pytest.approx(0.1)
    assert m.tpot_s == pytest.approx((0.32 - 0.1) / 3)
    assert m.itl_s == pytest.approx((0.05, 0.10, 0.05))
    assert m.e2e_s == 0.32 and m.output_tokens == 4


def test_tpot_uses_token_count_not_chunk_count():
    # two chunks carried five tokens: TPOT spreads the decode time over 4 tokens, ITL has one gap
    m = request_metrics(done([0.2, 0.6], e2e=0.6, tokens=5))
    assert m.tpot_s == pytest.approx(0.1)
    assert m.itl_s == pytest.approx((0.4,))


def test_tpot_undefined_for_one_token():
    m = request_metrics(done([0.2], e2e=0.21, tokens=1))
    assert m.tpot_s is None and m.itl_s == ()


@pytest.mark.parametrize("status", ["rejected", "error", "cancelled"])
def test_unfinished_requests_have_no_metrics(status):
    r = done([0.1], 0.2, 2)
    r.status = status
    assert request_metrics(r) is None


def test_percentiles_interpolate_linearly():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    assert stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert stats(values)["mean"] == pytest.approx(2.5)


def test_summary_counts_and_throughput():
    results = [
        done([0.1, 0.2, 0.3], 0.3, 3, 0),
        done([0.2, 0.4], 0.4, 2, 1),
        RequestResult(2, 10, 3, 0.5, 0.5, "rejected", 429),
        RequestResult(3, 10, 3, 0.6, 0.6, "error", 500),
        RequestResult(4, 10, 3, 0.7),  # never finished: cancelled
    ]
    c = counts(results)
    assert (c.total, c.completed, c.rejected, c.errors, c.cancelled, c.failed) == (5, 2, 1, 1, 1, 3)
    s = summarize(results, duration_s=2.0, rate=2.5)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(2.5)
    assert s.ttft_ms["mean"] == pytest.approx(150.0)
    # TPOTs: (0.3 - 0.1) / 2 = 100 ms and (0.4 - 0.2) / 1 = 200 ms
    assert s.tpot_ms["p50"] == pytest.approx(150.0)
    assert s.itl_ms["mean"] == pytest.approx(1e3 * (0.1 + 0.1 + 0.2) / 3)
    assert s.to_dict()["counts"]["total"] == 5
    # decoding, first token to end: 0.2 s and 0.2 s over 2 s; failed requests do not count
    assert s.decoding_concurrency == pytest.approx(0.2)
    assert summarize(results[2:], duration_s=2.0).decoding_concurrency is None
