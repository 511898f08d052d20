"""Speculative decoding's figures: engine counters, per-request delta fields, Prometheus series, span
attributes, and the decode role's config reaching the engine."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.observability import trace_attributes as ta
from pdserve.config import SpeculativeConfig
from pdserve.observability.metrics import ServingMetrics
from pdserve.services.worker import SpeculativeSettings, WorkerConfig


def _samples(metrics: ServingMetrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_acceptance_series_accumulate_over_requests():
    metrics = ServingMetrics("decode", "decode-0", "tiny")
    metrics.observe_speculation(10, 6, 3)
    metrics.observe_speculation(0, 0, 0)  # a request that never speculated changes nothing
    metrics.observe_speculation(10, 2, 2)
    samples = _samples(metrics)
    assert samples["pdserve_spec_draft_tokens_total"] == 20
    assert samples["pdserve_spec_accepted_tokens_total"] == 8
    assert samples["pdserve_spec_verifications_total"] == 5
    assert samples["pdserve_spec_acceptance_rate"] == 8 / 20
    assert samples["pdserve_spec_mean_accepted_length"] == 8 / 5


def test_span_attributes():
    attrs = ta.speculation_attributes(8, 6, 2)
    assert attrs[ta.SPEC_ACCEPTANCE_RATE] == 0.75 and attrs[ta.SPEC_MEAN_ACCEPTED_LENGTH] == 3.0
    assert attrs[ta.SPEC_DRAFT_TOKENS] == 8 and attrs[ta.SPEC_VERIFICATIONS] == 2


def test_worker_config_reaches_the_engine_config():
    assert WorkerConfig().engine_config().speculative is None
    config = WorkerConfig.model_validate({"speculative": {"num_speculative_tokens": 5, "prompt_lookup_max": 3}})
    spec = config.engine_config().speculative
    assert spec == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=3)
    assert SpeculativeSettings().engine_config() == SpeculativeConfig()  # one set of defaults
    assert WorkerConfig.model_validate(config.model_dump()) == config  # survives the trip to the replica


def test_system_config_turns_it_on_for_decode_only():
    from pdserve.services.app import SystemConfig

    system = SystemConfig.model_validate({"decode": {"speculative": {"num_speculative_tokens": 6}}})
    assert system.worker("decode").engine_config().speculative == SpeculativeConfig(num_speculative_tokens=6)
    assert system.worker("prefill").engine_config().speculative is None
