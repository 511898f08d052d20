"""SLO-driven autoscaling per role on a local multi-raylet cluster built from the Helm chart's autoscaling
example (deploy/helm/pdserve/ci/autoscaling-values.yaml): a head, a prefill pod and a decode pod, one raylet
each, with the chart's labels and CPUs; serveConfigV2 deployed through Serve's config path
(tests/helm/autoscale_driver.py, in a child process so it never meets the session's shared local Ray).

A step to long prompts adds a prefill replica, on the prefill pod, and no decode replica; a step to long
outputs adds a decode replica, on the decode pod, and no prefill replica; down to a trickle decode shrinks
back, and no request is lost (tests/integration/autoscale_steps.py, which the one-raylet test shares).

Deviations from the example, each for this machine: the built-in `tiny` model and no Redis tier (the
minimal CPU values), one pod per group with 3 CPUs (KubeRay's autoscaler adds pods; here the replicas must
fit the pods there are), at most 2 Serve replicas per role, the synthetic latency profile and fast delays
of autoscale_steps.SCALING in place of the example's measured profile and minutes-long delays (so the
decisions follow the traffic, not this machine's speed, within a test's time), and prompts of 32 tokens or
more sent to prefill (short ones are prefilled on decode)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.integration.autoscale_steps import SCALING, failures

HERE = Path(__file__).resolve().parent
CHART = HERE.parents[1] / "deploy" / "helm" / "pdserve"


def _overrides() -> dict:
    slo = {k: v for k, v in SCALING.items() if k not in ("min_replicas", "max_replicas")}

    def role() -> dict:
        return {"replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "3"}},
                "worker": {"num_cpus": 1, "num_blocks": 512},
                "autoscaling": {"enabled": True, "policy": "slo", "minReplicas": SCALING["min_replicas"],
                                "maxReplicas": SCALING["max_replicas"], "slo": slo}}

    return {"prefill": role(), "decode": role(), "router": {"config": {"disaggregate_min_prompt_tokens": 32}}}


def test_the_charts_autoscaling_scales_each_role_on_its_own_pods(helm, tmp_path):
    (tmp_path / "test-values.yaml").write_text(yaml.safe_dump(_overrides()))
    rendered = subprocess.run(
        [helm, "template", "pdserve", str(CHART), "-f", str(CHART / "ci" / "minimal-cpu-values.yaml"),
         "-f", str(CHART / "ci" / "autoscaling-values.yaml"), "-f", str(tmp_path / "test-values.yaml")],
        check=True, capture_output=True, text=True).stdout
    (rs,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "RayService"]
    (tmp_path / "rs.json").write_text(json.dumps(rs))
    proc = subprocess.run([sys.executable, str(HERE / "autoscale_driver.py"), str(tmp_path / "rs.json"),
                           str(tmp_path / "out.json")], capture_output=True, text=True, timeout=720)
    out = json.loads((tmp_path / "out.json").read_text()) if (tmp_path / "out.json").exists() else {}
    assert proc.returncode == 0, (out.get("error"), proc.stderr[-4000:])

    assert out["start"] == {"prefill": 1, "decode": 1}
    assert not failures(out["steps"]), failures(out["steps"])
    steps = {s["name"]: s for s in out["steps"]}
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    for step, role in (("long_prompts", "prefill"), ("long_outputs", "decode")):
        placed = [r for r in steps[step]["snapshot"] if r["class_name"].endswith(f":{role}")]
        assert len(placed) == 2, (step, placed)  # the one that was there and the one the step added
        for r in placed:
            assert r["group"] == groups[role]["groupName"] and r["labels"] == groups[role]["labels"], r
