"""Per-request SLOs and priority: body extension, headers, defaults, and validation."""

from __future__ import annotations

import pytest
from pdserve.api.contract import Priority
from pdserve.models.tiny import resolve_model_path
from pdserve.models.tokenizer import Tokenizer
from pdserve.services.router.admission import merge_slo_headers, prepare
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.errors import APIError

CONFIG = RouterConfig(slo_ttft_s=2.0, slo_tpot_s=0.2)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(resolve_model_path("tiny"))


def _prepare(tokenizer, body, headers=None):
    data = merge_slo_headers({"model": "tiny", "prompt": "hello", **body}, headers or {})
    return prepare(data, False, CONFIG, tokenizer, 384)


def test_defaults_body_and_headers(tokenizer):
    p = _prepare(tokenizer, {})
    assert (p.ttft_slo_s, p.tpot_slo_s, p.priority) == (2.0, 0.2, Priority.INTERACTIVE)
    p = _prepare(tokenizer, {"slo": {"ttft_ms": 500}, "priority": "batch"})
    assert (p.ttft_slo_s, p.tpot_slo_s, p.priority) == (0.5, 0.2, Priority.BATCH)
    p = _prepare(tokenizer, {}, {"x-slo-ttft-ms": "250", "x-slo-tpot-ms": "40", "x-priority": "batch"})
    assert (p.ttft_slo_s, p.tpot_slo_s, p.priority) == (0.25, 0.04, Priority.BATCH)
    # the body wins over a header for the same field
    p = _prepare(tokenizer, {"slo": {"ttft_ms": 900}}, {"x-slo-ttft-ms": "250", "x-slo-tpot-ms": "40"})
    assert (p.ttft_slo_s, p.tpot_slo_s) == (0.9, 0.04)


@pytest.mark.parametrize("body,headers,param", [
    ({"slo": {"ttft_ms": -1}}, {}, "slo.ttft_ms"),
    ({"slo": {"bogus": 1}}, {}, "slo.bogus"),
    ({"priority": "urgent"}, {}, "priority"),
    ({}, {"x-slo-tpot-ms": "fast"}, "slo"),
    ({}, {"x-priority": "vip"}, "priority"),
])
def test_bad_slo_or_priority_is_400(tokenizer, body, headers, param):
    with pytest.raises(APIError) as info:
        _prepare(tokenizer, body, headers)
    assert info.value.status == 400 and info.value.param == param
