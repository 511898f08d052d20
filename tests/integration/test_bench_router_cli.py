"""`pdserve bench router --json` as users run it: real Serve apps, stdout one JSON object and nothing else."""

import json
import os
import subprocess
import sys
from pathlib import Path

CLI = [str(Path(sys.executable).with_name("pdserve")), "bench", "router", "--json", "--requests", "4",
       "--concurrency", "1", "--output-tokens", "8"]


def _user_env() -> dict[str, str]:
    """A user's environment: not the Ray/Serve variables this session's shared Serve instance put in os.environ."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}


def test_bench_router_json_is_the_only_stdout():
    done = subprocess.run(CLI, capture_output=True, text=True, timeout=420, env=_user_env(), check=False)
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


def test_bench_router_ends_cleanly_in_a_shell_with_pdserve_serves_ray_variables():
    """With the variables `pdserve serve` runs Serve under (the router of a handle on the caller's own loop
    among them), the bench used to finish its work and then crash in `serve.shutdown()` on a closed loop."""
    from pdserve.runtime.serve_env import BASE_ENV

    assert BASE_ENV["RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP"] == "0"
    done = subprocess.run(CLI, capture_output=True, text=True, timeout=420, env={**_user_env(), **BASE_ENV},
                          check=False)
    assert done.returncode == 0 and "Event loop is closed" not in done.stderr, done.stderr[-4000:]
    assert json.loads(done.stdout)["bench"] == "router"
