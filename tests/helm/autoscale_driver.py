"""The Helm chart's autoscaling example, live on a local multi-raylet Ray cluster, in its own process:

    python autoscale_driver.py RAYSERVICE_JSON OUT_JSON

The cluster and the deployment come from multinode_driver.serving (one raylet per pod, serveConfigV2
through Serve's config path). Then the steps of tests/integration/autoscale_steps.py run against the API:
long prompts, quiet, long outputs, a trickle. Written as JSON: each step's record (replicas per role seen,
every request's status and tokens) with, when a step reached its replicas, where each replica ran."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.integration.autoscale_steps

from multinode_driver import Serving, replica_nodes, run_cli, serving  # noqa: E402

from tests.integration.autoscale_steps import run_steps  # noqa: E402


def placed(up: Serving, want: dict[str, int], limit_s: float = 60) -> list[dict[str, Any]]:
    """Where each replica runs, once every role has its `want` replicas alive (a starting one counts for Serve
    before its actor is), or as it is after `limit_s`."""
    deadline = time.monotonic() + limit_s
    while True:
        replicas = replica_nodes(up)
        alive = {role: sum(r["class_name"].endswith(f":{role}") for r in replicas) for role in want}
        if alive == want or time.monotonic() > deadline:
            return replicas
        time.sleep(0.5)


def run(rayservice: dict[str, Any]) -> dict[str, Any]:
    from ray import serve

    def replicas() -> dict[str, int]:
        deployments = serve.status().applications["pdserve"].deployments
        return {role: sum(n for state, n in deployments[role].replica_states.items()
                          if state in ("RUNNING", "STARTING"))
                for role in ("prefill", "decode")}

    try:
        with serving(rayservice) as up:
            with urllib.request.urlopen(f"{up.base}/v1/models", timeout=60) as response:
                model = json.load(response)["data"][0]["id"]
            start = replicas()
            steps = run_steps(up.base, model, replicas, on_reached=lambda want: placed(up, want))
            return {"deploy_s": up.deploy_s, "model": model, "start": start, "steps": steps, "groups": up.groups,
                    "head_node_id": up.head_node_id}
    except RuntimeError as exc:
        return {"error": str(exc)}


if __name__ == "__main__":
    sys.exit(run_cli(run, sys.argv[1:]))
