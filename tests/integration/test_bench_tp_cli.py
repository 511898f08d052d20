"""`pdserve bench tp --json` as a user runs it (on the tiny model, quick): one JSON line with the parity keys,
the TP=1 and TP=2 step timings with their all-reduce share, and the handoff's gather and scatter at TP=2."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_tp_prints_parity_timings_and_the_handoffs_cost():
    done = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "bench", "tp", "--model", "tiny", "--quick",
                           "--json"], check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = done.stdout.strip().splitlines()
    result = json.loads(line)
    assert result["max_abs_logit_diff_tp2"] < 1e-4 and result["greedy_identical"] is True
    for tp in ("tp1", "tp2"):
        assert set(result[tp]) == {"prefill_1k", "decode_b1", "decode_b16"}
        assert all(step["ms"] > 0 and 0 <= step["allreduce_share"] <= 1 for step in result[tp].values())
    assert all(step["allreduce_share"] == 0 for step in result["tp1"].values())  # one process: no all-reduce
    # tiny: 4 layers x K and V x 1024 tokens x 4 KV heads x 32 dims, fp32
    assert result["handoff_kv_bytes_1k"] == 4 * 2 * 1024 * 4 * 32 * 4
    for key in ("handoff_gather_1k", "handoff_scatter_1k", "handoff_copy_1k"):
        assert result[key]["ms"] >= result[key]["ms_min"] > 0
    assert result["handoff_gather_over_copy"] > 0 and result["handoff_gather_over_prefill_1k"] > 0
