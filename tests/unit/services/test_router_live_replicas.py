"""pdserve_router_live_replicas: the router's view of live replicas per role, 0 for a role with none."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.services.router.metrics import APIMetrics


def test_live_replicas_per_role_read_at_every_scrape():
    registry = CollectorRegistry()
    live = {"prefill": 1, "decode": 2}
    APIMetrics(registry).watch_replicas(registry, live.__getitem__, ("prefill", "decode"))

    def scrape() -> dict[str, float]:
        [family] = [f for f in text_string_to_metric_families(generate_latest(registry).decode())
                    if f.name == "pdserve_router_live_replicas"]
        return {s.labels["role"]: s.value for s in family.samples}

    assert scrape() == {"prefill": 1, "decode": 2}
    live["decode"] = 0
    assert scrape() == {"prefill": 1, "decode": 0}
