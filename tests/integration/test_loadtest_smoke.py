"""The smoke scenario through the real pipeline: Ray Serve apps, HTTP streaming, sweep, report."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest

pytest.importorskip("ray")

from pdserve.loadtest.scenario import Scenario, run_scenario

SMOKE = files("pdserve.loadtest") / "scenarios" / "smoke.yaml"


def test_smoke_scenario_end_to_end(ray_serve, tmp_path):
    import ray

    scenario = Scenario.from_yaml(SMOKE)
    summary = run_scenario(scenario, tmp_path, progress=False, log=lambda m: None)

    # it joined the session's Ray and Serve and left them running
    assert ray.is_initialized()
    assert not [name for name in ray_serve.status().applications if name.startswith("loadtest-")]

    for name in ("summary.json", "summary.md", "attainment_vs_rate.png", "latency_cdf.png", "throughput_vs_rate.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert [t["name"] for t in summary["targets"]] == [t.name for t in scenario.targets]
    assert summary["slo"]["ttft_ms"] > 0 and summary["slo"]["tpot_ms"] > 0
    assert summary["placement_bound"] is None  # a synthetic workload: no trace to bound

    for target in summary["targets"]:
        assert target["idle"]["ttft_ms"] > 0
        batch = target["batch_probe"]  # k requests decoding together, each round measured
        assert batch["k"] == scenario.batch_probe_requests and batch["tpot_ms"] > 0
        assert len(batch["round_tpot_ms"]) == batch["rounds"] and all(t > 0 for t in batch["round_tpot_ms"])
        serving = target["serving_probe"]  # short prompts one at a time, each measured
        assert serving["requests"] == scenario.serving_probe_requests == len(serving["each_ttft_ms"])
        assert all(t > 0 for t in serving["each_ttft_ms"]) and serving["ttft_ms"] > 0
        assert scenario.sweep.rates[0] in [p["rate"] for p in target["points"]]
        assert len(target["points"]) <= scenario.sweep.max_runs
        for point in target["points"]:
            c = point["summary"]["counts"]
            assert c["total"] == scenario.load.num_requests
            assert c["completed"] + c["rejected"] + c["errors"] + c["cancelled"] == c["total"]
            assert c["completed"] > 0
            run = json.loads((tmp_path / "runs" / target["name"] / f"rate-{point['rate']:.4g}.json").read_text())
            assert len(run["requests"]) == c["total"]
            assert sum(r["status"] == "ok" for r in run["requests"]) == c["completed"]
            done = [r for r in run["requests"] if r["status"] == "ok"]
            assert all(r["output_tokens"] == r["expected_output_len"] for r in done)  # exact output lengths
            assert 0.0 <= point["attainment"] <= 1.0
            assert point["replica_cpu_s"]["decode"] > 0  # the target's own replica processes, read from /proc
            host = point["host_cpu_s"]  # every core's busy time covers the replicas' and the client's
            assert host["host"] >= point["replica_cpu_s"]["decode"] and host["client"] > 0
            steps = point["engine_steps"]["decode"]  # the engines' own step counters, read from /metrics
            assert steps["replicas"] >= 1 and steps["num_steps"] >= max(r["output_tokens"] for r in done)
            assert 0 < steps["step_cpu_s"] <= steps["step_s"] + 0.05 and steps["step_wait_s"] >= 0
        quiet = target["quiet_cpu_s"]
        assert quiet["seconds"] == 10.0 and 0 <= quiet["host"] < 2 * quiet["seconds"] and "decode" in quiet["replicas"]

    md = (tmp_path / "summary.md").read_text()
    assert "## Verdict" in md and "![attainment_vs_rate](attainment_vs_rate.png)" in md


def test_the_smoke_scenario_as_users_run_it(tmp_path):
    """`pdserve-loadtest scenario FILE --out DIR` in a process of its own: it starts its own Ray with the
    settings `pdserve serve` uses (direct ingress: each target's router on a port of its own), and every
    request it sends is answered."""
    import subprocess
    import sys
    from pathlib import Path

    cli = Path(sys.executable).with_name("pdserve-loadtest")
    out = subprocess.run([str(cli), "scenario", str(SMOKE), "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    for target in summary["targets"]:
        for point in target["points"]:
            c = point["summary"]["counts"]
            assert c["completed"] == c["total"] > 0, (target["name"], c)
