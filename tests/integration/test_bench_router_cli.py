"""`pdserve bench router --json` as users run it: real Serve apps, stdout one JSON object and nothing else."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_bench_router_json_is_the_only_stdout():
    script = Path(sys.executable).with_name("pdserve")
    # a user's environment: not the Ray/Serve variables this session's shared Serve instance put in os.environ
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run(
        [str(script), "bench", "router", "--json", "--requests", "4", "--concurrency", "1", "--output-tokens", "8"],
        capture_output=True, text=True, timeout=420, env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, done.stdout[:2000]
    result = json.loads(lines[0])
    assert result["bench"] == "router" and result["concurrency_1"]
    assert result["added_ttft_ms_p50"] is not None and result["tpot_ratio_c1"] > 0
    for path in ("direct", "disaggregated", "colocated"):  # the engine's step, and TPOT beyond it
        block = result["concurrency_1"][path]
        assert 0 < block["step_ms_p50"] < block["tpot_ms_p50"] + 1, block
        assert abs(block["between_steps_ms"] - (block["tpot_ms_p50"] - block["step_ms_p50"])) < 0.002
        assert 0 < block["engine_gap_ms_p50"] < block["tpot_ms_p50"], block
    idle = result["idle_replica_cpu_pct"]  # every replica of both apps, measured (some CPU: the stats polls)
    assert set(idle) == {"disaggregated", "colocated"}, idle
    assert set(idle["disaggregated"]) == {"router", "prefill", "decode"}, idle
    assert set(idle["colocated"]) == {"router", "decode"}, idle
    assert all(0 < pct < 200 for app in idle.values() for pct in app.values()), idle
