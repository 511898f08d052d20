"""TracingConfig from the standard OTEL_* variables (and PDSERVE_TRACE_CONTENT), and back."""

from __future__ import annotations

import pytest

from pdserve.observability.tracing import build_sampler
from pdserve.observability.tracing_config import DEFAULT_GRPC_ENDPOINT, DEFAULT_HTTP_ENDPOINT, TracingConfig

CASES = [
    (
        {},
        {
            "exporters": (),
            "protocol": "grpc",
            "endpoint": DEFAULT_GRPC_ENDPOINT,
            "sampler": "parentbased_always_on",
            "sampler_ratio": 1.0,
            "service_name": None,
            "record_content": False,
            "headers": (),
            "resource_attributes": (),
        },
    ),
    ({"OTEL_TRACES_EXPORTER": "none"}, {"exporters": ()}),
    ({"OTEL_TRACES_EXPORTER": " OTLP "}, {"exporters": ("otlp",), "endpoint": DEFAULT_GRPC_ENDPOINT}),
    ({"OTEL_TRACES_EXPORTER": "otlp,console,otlp"}, {"exporters": ("otlp", "console")}),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, {"exporters": ()}),
    (
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
        {"protocol": "http/protobuf", "endpoint": DEFAULT_HTTP_ENDPOINT},
    ),
    (
        {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
        {"protocol": "grpc", "endpoint": DEFAULT_GRPC_ENDPOINT},
    ),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, {"endpoint": "http://collector:4317"}),
    (
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "https://collector:4318/",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        },
        {"endpoint": "https://collector:4318/v1/traces"},
    ),
    (
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4318",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/custom",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        },
        {"endpoint": "http://t:9/custom"},
    ),
    (
        {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
        {"sampler": "traceidratio", "sampler_ratio": 0.25},
    ),
    (
        {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio"},
        {"sampler": "parentbased_traceidratio", "sampler_ratio": 1.0},
    ),
    (
        {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"},
        {"sampler_ratio": 0.0},
    ),
    (
        {"OTEL_TRACES_SAMPLER": "ALWAYS_ON", "OTEL_TRACES_SAMPLER_ARG": "0.1"},
        {"sampler": "always_on", "sampler_ratio": 1.0},
    ),
    ({"OTEL_TRACES_SAMPLER": "always_off"}, {"sampler": "always_off"}),
    ({"OTEL_TRACES_SAMPLER": "parentbased_always_on"}, {"sampler": "parentbased_always_on"}),
    ({"OTEL_SERVICE_NAME": "pdserve-prod"}, {"service_name": "pdserve-prod"}),
    ({"PDSERVE_TRACE_CONTENT": "1"}, {"record_content": True}),
    ({"PDSERVE_TRACE_CONTENT": "Yes"}, {"record_content": True}),
    ({"PDSERVE_TRACE_CONTENT": "off"}, {"record_content": False}),
    (
        {"OTEL_EXPORTER_OTLP_HEADERS": "api-key=s3cret, x-team=ml%20ops"},
        {"headers": (("api-key", "s3cret"), ("x-team", "ml ops"))},
    ),
    (
        {"OTEL_EXPORTER_OTLP_HEADERS": "a=1", "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "b=2"},
        {"headers": (("b", "2"),)},
    ),
    (
        {"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod,k8s.pod.name=p-1"},
        {"resource_attributes": (("deployment.environment", "prod"), ("k8s.pod.name", "p-1"))},
    ),
]


@pytest.mark.parametrize("env,expected", CASES)
def test_from_env(env, expected):
    config = TracingConfig.from_env(env)
    assert {name: getattr(config, name) for name in expected} == expected


ERRORS = [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "unknown trace exporter"),
    ({"OTEL_TRACES_EXPORTER": "none,otlp"}, "cannot be combined"),
    ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "protocol"),
    ({"OTEL_TRACES_SAMPLER": "sometimes"}, "sampler"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "half"}, "SAMPLER_ARG"),
    ({"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.5"}, r"\[0, 1\]"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}, "scheme"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector:4317"}, "scheme"),
    ({"PDSERVE_TRACE_CONTENT": "maybe"}, "PDSERVE_TRACE_CONTENT"),
    ({"OTEL_SDK_DISABLED": "perhaps"}, "OTEL_SDK_DISABLED"),
    ({"OTEL_EXPORTER_OTLP_HEADERS": "novalue"}, "key=value"),
]


@pytest.mark.parametrize("env,message", ERRORS)
def test_from_env_rejects(env, message):
    with pytest.raises(ValueError, match=message):
        TracingConfig.from_env(env)


@pytest.mark.parametrize("env", [env for env, _ in CASES])
def test_to_env_round_trips(env):
    config = TracingConfig.from_env(env)
    assert TracingConfig.from_env(config.to_env()) == config


def test_to_env_wins_over_general_variables_already_set():
    config = TracingConfig.from_env(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://router-side:4318",
        }
    )
    worker_env = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://elsewhere:4317",
    }
    assert TracingConfig.from_env({**worker_env, **config.to_env()}) == config


def test_from_env_defaults_to_process_environment(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-process")
    config = TracingConfig.from_env()
    assert config.exporters == ("console",) and config.service_name == "from-process"


def test_headers_stay_out_of_repr():
    assert "s3cret" not in repr(TracingConfig.from_env({"OTEL_EXPORTER_OTLP_HEADERS": "api-key=s3cret"}))


@pytest.mark.parametrize(
    "sampler,arg,description",
    [
        ("always_on", "", "AlwaysOnSampler"),
        ("always_off", "", "AlwaysOffSampler"),
        ("traceidratio", "0.5", "TraceIdRatioBased{0.5}"),
        ("parentbased_always_on", "", "ParentBased{root:AlwaysOnSampler"),
        ("parentbased_always_off", "", "ParentBased{root:AlwaysOffSampler"),
        ("parentbased_traceidratio", "0.125", "ParentBased{root:TraceIdRatioBased{0.125}"),
    ],
)
def test_build_sampler(sampler, arg, description):
    config = TracingConfig.from_env({"OTEL_TRACES_SAMPLER": sampler, "OTEL_TRACES_SAMPLER_ARG": arg})
    assert build_sampler(config).get_description().startswith(description)
