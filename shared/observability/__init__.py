"""What pdserve tells operators: Prometheus metrics, OpenTelemetry tracing, SLO attainment."""
