"""Tracing settings, read from the standard OpenTelemetry environment variables.

`TracingConfig.from_env(env)` parses a mapping (os.environ by default); `to_env()` writes the resolved
settings back as variables, so a process can hand its exact settings to the Ray workers it starts
(`runtime_env={"env_vars": config.to_env()}`): `from_env(config.to_env()) == config`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import quote, unquote

EXPORTERS = ("otlp", "console")
PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = (
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
)
RATIO_SAMPLERS = ("traceidratio", "parentbased_traceidratio")

TRACE_CONTENT_ENV = "PDSERVE_TRACE_CONTENT"
DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318/v1/traces"
HTTP_TRACES_PATH = "/v1/traces"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _get(env: Mapping[str, str], name: str) -> str:
    return env.get(name, "").strip()


def _parse_bool(name: str, value: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"{name} must be a boolean (true/false/1/0), got {value!r}")


def _parse_pairs(name: str, value: str) -> tuple[tuple[str, str], ...]:
    """W3C-baggage-like `k1=v1,k2=v2` lists (OTEL_EXPORTER_OTLP_HEADERS, OTEL_RESOURCE_ATTRIBUTES)."""
    pairs = []
    for item in value.split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{name}: expected key=value, got {item!r}")
        pairs.append((unquote(key.strip()), unquote(val.strip())))
    return tuple(pairs)


def _format_pairs(pairs: tuple[tuple[str, str], ...]) -> str:
    return ",".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in pairs)


def _check_url(name: str, url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{name} must be a URL with an http:// or https:// scheme, got {url!r}")
    return url


@dataclass(frozen=True)
class TracingConfig:
    # Empty means tracing is off (OTEL_TRACES_EXPORTER=none): a no-op tracer, no propagation.
    exporters: tuple[str, ...] = ()
    protocol: str = "grpc"
    # The traces endpoint itself: for http/protobuf the full URL including /v1/traces.
    endpoint: str = DEFAULT_GRPC_ENDPOINT
    sampler: str = "parentbased_always_on"
    sampler_ratio: float = 1.0
    service_name: str | None = None
    record_content: bool = False
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    resource_attributes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "exporters", tuple(self.exporters))
        unknown = [e for e in self.exporters if e not in EXPORTERS]
        if unknown:
            raise ValueError(f"unknown trace exporter(s) {unknown}; known: {list(EXPORTERS)} or none")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"OTLP protocol must be one of {list(PROTOCOLS)}, got {self.protocol!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {list(SAMPLERS)}, got {self.sampler!r}")
        if not 0.0 <= self.sampler_ratio <= 1.0:
            raise ValueError(f"sampler ratio must be in [0, 1], got {self.sampler_ratio}")
        _check_url("OTLP traces endpoint", self.endpoint)

    @property
    def enabled(self) -> bool:
        return bool(self.exporters)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TracingConfig:
        env = os.environ if env is None else env
        exporters = _parse_exporters(_get(env, "OTEL_TRACES_EXPORTER"))
        if _parse_bool("OTEL_SDK_DISABLED", _get(env, "OTEL_SDK_DISABLED")):
            exporters = ()
        protocol = (
            _get(env, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or _get(env, "OTEL_EXPORTER_OTLP_PROTOCOL")
            or "grpc"
        )
        sampler = (_get(env, "OTEL_TRACES_SAMPLER") or "parentbased_always_on").lower()
        ratio_text = _get(env, "OTEL_TRACES_SAMPLER_ARG")
        try:
            ratio = float(ratio_text) if ratio_text and sampler in RATIO_SAMPLERS else 1.0
        except ValueError:
            raise ValueError(
                f"OTEL_TRACES_SAMPLER_ARG must be a number in [0, 1], got {ratio_text!r}"
            ) from None
        headers = _get(env, "OTEL_EXPORTER_OTLP_TRACES_HEADERS") or _get(env, "OTEL_EXPORTER_OTLP_HEADERS")
        return cls(
            exporters=exporters,
            protocol=protocol,
            endpoint=_resolve_endpoint(env, protocol),
            sampler=sampler,
            sampler_ratio=ratio,
            service_name=_get(env, "OTEL_SERVICE_NAME") or None,
            record_content=_parse_bool(TRACE_CONTENT_ENV, _get(env, TRACE_CONTENT_ENV)),
            headers=_parse_pairs("OTEL_EXPORTER_OTLP_HEADERS", headers),
            resource_attributes=_parse_pairs(
                "OTEL_RESOURCE_ATTRIBUTES", _get(env, "OTEL_RESOURCE_ATTRIBUTES")
            ),
        )

    def to_env(self) -> dict[str, str]:
        """Every setting, under the most specific variable name, so these win over general ones
        (OTEL_EXPORTER_OTLP_*) that may already be set in the receiving process."""
        env = {
            "OTEL_TRACES_EXPORTER": ",".join(self.exporters) or "none",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": self.protocol,
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": self.endpoint,
            "OTEL_TRACES_SAMPLER": self.sampler,
            "OTEL_TRACES_SAMPLER_ARG": repr(self.sampler_ratio),
            TRACE_CONTENT_ENV: "true" if self.record_content else "false",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": _format_pairs(self.headers),
            "OTEL_RESOURCE_ATTRIBUTES": _format_pairs(self.resource_attributes),
        }
        if self.service_name:
            env["OTEL_SERVICE_NAME"] = self.service_name
        return env


def _parse_exporters(value: str) -> tuple[str, ...]:
    names = [n.strip().lower() for n in value.split(",") if n.strip()]
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"OTEL_TRACES_EXPORTER: 'none' cannot be combined with others, got {value!r}")
        return ()
    return tuple(dict.fromkeys(names))


def _resolve_endpoint(env: Mapping[str, str], protocol: str) -> str:
    """The signal-specific variable is used as is; the general one is a base URL to which
    OTLP/HTTP appends /v1/traces (gRPC uses it unchanged)."""
    if specific := _get(env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return _check_url("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", specific)
    if base := _get(env, "OTEL_EXPORTER_OTLP_ENDPOINT"):
        _check_url("OTEL_EXPORTER_OTLP_ENDPOINT", base)
        return base.rstrip("/") + HTTP_TRACES_PATH if protocol == "http/protobuf" else base
    return DEFAULT_HTTP_ENDPOINT if protocol == "http/protobuf" else DEFAULT_GRPC_ENDPOINT
