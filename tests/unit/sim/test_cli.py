"""`python -m pdserve.sim` and `pdserve-loadtest simulate`: JSON on success; a bad file is one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pdserve.loadtest.cli import main as loadtest_main
from pdserve.sim.cli import main

REPO = Path(__file__).resolve().parents[3]
PROFILE = REPO / "loadtest/scenarios/profiles/random-llama-h512-l4.json"
TRACE = REPO / "loadtest/scenarios/traces/prefix-routing.jsonl"


def bad_files(tmp_path: Path) -> dict[str, Path]:
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "wrong.json").write_text('{"version": 1, "models": {"default": {"prefill": {}}}}')
    (tmp_path / "garbage.jsonl").write_text('{"timestamp": 1, "input_length": 5}\n')
    (tmp_path / "garbage.yaml").write_text("name: [unclosed\n")
    return {name: tmp_path / name for name in ("garbage.json", "wrong.json", "garbage.jsonl", "garbage.yaml")} | {
        "missing": tmp_path / "missing"}


@pytest.mark.parametrize(("argv", "needle"), [
    (["trace", "{missing}", "--profile", str(PROFILE)], "cannot read trace"),
    (["trace", "{garbage.jsonl}", "--profile", str(PROFILE)], "not a trace record"),
    (["trace", str(TRACE), "--profile", "{missing}"], "cannot read profile"),
    (["trace", str(TRACE), "--profile", "{garbage.json}"], "not a latency profile"),
    (["trace", str(TRACE), "--profile", "{wrong.json}"], "not a latency profile"),
    (["scenario", "{missing}"], "cannot read scenario"),
    (["scenario", "{garbage.yaml}"], "not YAML"),
    (["scenario", str(REPO / "loadtest/scenarios/router-policies.yaml"), "--profile", "{garbage.json}"],
     "not a latency profile"),
    (["autoscale", "--profile", "{missing}"], "cannot read profile"),
])
def test_a_bad_file_is_one_line_and_exit_code_2(tmp_path, capsys, argv, needle):
    files = bad_files(tmp_path)
    argv = [str(files[a[1:-1]]) if a.startswith("{") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_users_command_line_exit_code_2_without_a_traceback(tmp_path):
    result = subprocess.run([sys.executable, "-m", "pdserve.sim", "trace", str(tmp_path / "none.jsonl"),
                             "--profile", str(PROFILE), "--json"], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("pdserve.sim: cannot read trace") and result.stderr.count("\n") == 1
    assert result.stdout == ""


def test_loadtest_simulate_exit_code_2_on_a_missing_scenario(tmp_path, capsys):
    assert loadtest_main(["simulate", str(tmp_path / "none.yaml"), "--json"]) == 2
    assert "cannot read scenario" in capsys.readouterr().err


def test_a_committed_scenario_prints_figures_per_target(capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # scenario paths are relative to the repository, as for the live runner
    assert loadtest_main(["simulate", "loadtest/scenarios/disagg-vs-colocated.yaml", "--rates", "0.5,1",
                          "--requests", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["slo"] == {"ttft_ms": 3650.0, "tpot_ms": 22.8}
    assert set(out["targets"]) == {"disaggregated", "colocated-no-chunking", "colocated-chunked"}
    point = out["targets"]["disaggregated"]["points"]["0.5"]
    assert point["num_requests"] == 12 and point["completed"] == 12
    for key in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s", "slo_attainment", "goodput_rps"):
        assert point[key] > 0


def test_a_trace_replays_with_per_request_times(capsys):
    argv = ["trace", str(TRACE), "--profile", str(PROFILE), "--mode", "colocated", "--decode", "3",
            "--policy", "kv_aware", "--rate-scale", "3", "--json"]
    assert main(argv) == 0
    blind = json.loads(capsys.readouterr().out)
    assert main([*argv, "--trace-block-size", "64", "--per-request"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ttft_p50_s"] < blind["ttft_p50_s"]  # the shared system prompts and histories are cached
    assert out["num_requests"] == 84 == out["completed"] == len(out["requests"])
    first = out["requests"][0]
    assert first["finish_s"] > first["first_token_s"] > first["arrival_s"] == 0.0
