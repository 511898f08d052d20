"""SLO-driven autoscaling per role, live: the whole system (router, prefill, decode) as a Serve app with
`prefill.autoscaling` and `decode.autoscaling` (policy slo, 1..2 replicas, fast intervals), on the session's
one-raylet Ray. A step to long-prompt load adds a prefill replica and not a decode one; a step to long-output
load adds decode and not prefill; with the load down to a trickle decode shrinks back to one, and every
request completes. The steps, the synthetic profile and the verdict: autoscale_steps.py beside this file
(tests/helm/test_autoscale_multinode.py runs the same on a multi-raylet cluster from the Helm chart)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from pdserve.services.app import SystemConfig, build_system
from tests.integration.autoscale_steps import SCALING, failures, run_steps

APP = "pdserve-autoscale"


@pytest.fixture(scope="module")
def server(ray_serve):
    worker = {"num_cpus": 0, "num_blocks": 512, "autoscaling": SCALING}
    config = SystemConfig(prefill=worker, decode=worker, router={"num_cpus": 0, "disaggregate_min_prompt_tokens": 32})
    ray_serve.run(build_system(config), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_serve.http_port}/{APP}"
    ray_serve.delete(APP)


def replicas(ray_serve) -> dict[str, int]:
    """Replicas per role that Serve runs or is starting (not those stopping)."""
    deployments = ray_serve.status().applications[APP].deployments
    return {role: sum(n for state, n in deployments[role].replica_states.items() if state in ("RUNNING", "STARTING"))
            for role in ("prefill", "decode")}


def test_each_role_scales_on_its_own_load_and_scale_down_loses_no_request(ray_serve, server):
    assert replicas(ray_serve) == {"prefill": 1, "decode": 1}
    records = run_steps(server, "tiny", lambda: replicas(ray_serve))
    assert not failures(records), failures(records)
