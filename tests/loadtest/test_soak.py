"""`pdserve-loadtest soak`: the accounting rules (each can fail a run), and a small real soak as users run it:
a disaggregated system on its own Ray (2 prefill + 2 decode replicas, UCX), disconnects, bad inputs and
one replica of each role killed with SIGKILL; every request accounted for, no KV lease or block left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.loadtest.soak import BAD_INPUTS, Outcome, SoakConfig, classify, plan, request_body

WINDOW = [(10.0, 20.0)]


def _outcome(kind: str = "valid", **fields) -> Outcome:
    return Outcome(0, kind, sent_s=fields.pop("sent_s", 1.0), ended_s=fields.pop("ended_s", 2.0), **fields)


@pytest.mark.parametrize(("outcome", "verdict"), [
    (_outcome(http_status=200, done=True, num_tokens=8, usage_tokens=8), "completed"),
    (_outcome(http_status=200, done=True, num_tokens=7, usage_tokens=7), "unaccounted"),  # a token short
    (_outcome(http_status=200, done=False, num_tokens=8, usage_tokens=8), "unaccounted"),  # no [DONE]
    (_outcome(http_status=200, done=False, num_tokens=3, note="RemoteProtocolError"), "unaccounted"),
    (_outcome(http_status=503, error_type="service_unavailable"), "failed_clean"),
    (_outcome(http_status=429, error_type="rate_limit_error"), "failed_clean"),
    (_outcome(http_status=500, error_type="internal_error"), "unaccounted"),  # outside every kill window
    (_outcome(http_status=500, error_type="internal_error", sent_s=9.0, ended_s=11.0), "failed_clean"),
    (_outcome(http_status=500, error_type=None, sent_s=9.0, ended_s=11.0), "unaccounted"),  # not an OpenAI body
    (_outcome(http_status=200, done=True, error_type="internal_error", num_tokens=3), "unaccounted"),
    (_outcome(http_status=200, done=True, error_type="internal_error", sent_s=12.0, ended_s=13.0), "failed_clean"),
    (_outcome(http_status=200, done=False, error_type="internal_error", sent_s=12.0), "unaccounted"),  # no [DONE]
    (_outcome("bad:n_zero", http_status=400, error_type="invalid_request_error"), "rejected_bad_input"),
    (_outcome("bad:n_zero", http_status=400, error_type=None), "unaccounted"),
    (_outcome("bad:n_zero", http_status=500, error_type="internal_error"), "unaccounted"),
    (_outcome("bad:n_zero", http_status=200, done=True, num_tokens=8, usage_tokens=8), "unaccounted"),
    (_outcome("disconnect:mid_stream", http_status=200, num_tokens=4, left_at="mid_stream"), "disconnected"),
    (_outcome("disconnect:mid_stream", http_status=200, done=True, num_tokens=8, usage_tokens=8), "completed"),
    (_outcome(ended_s=None, note="still open at the deadline"), "unaccounted"),
])
def test_every_outcome_has_one_verdict(outcome, verdict):
    assert classify(outcome, 8, WINDOW) == verdict


def test_plan_mixes_kinds_and_cycles_every_bad_input():
    config = SoakConfig(num_requests=600)
    kinds = plan(config, 600, seed=0)
    assert kinds == plan(config, 600, seed=0)
    bad = [k for k in kinds if k.startswith("bad:")]
    disconnects = [k for k in kinds if k.startswith("disconnect:")]
    assert 0.05 < len(bad) / 600 < 0.15 and 0.25 < len(disconnects) / 600 < 0.42
    assert {k[4:] for k in bad[:len(BAD_INPUTS)]} == {name for name, _ in BAD_INPUTS}


def test_bad_bodies_change_one_field_and_kills_need_two_replicas():
    from pdserve.loadtest.workloads import RequestSpec

    spec = RequestSpec((1, 2, 3), 4)
    assert request_body("tiny", spec, "bad:n_zero")["n"] == 0
    assert "prompt" not in request_body("tiny", spec, "bad:prompt_missing")
    assert request_body("tiny", spec, "bad:not_json") is None
    assert request_body("tiny", spec, "valid")["max_tokens"] == 4
    with pytest.raises(ValueError):
        SoakConfig(decode_replicas=1)
    SoakConfig(decode_replicas=1, prefill_replicas=1, kill=False)


def test_a_small_soak_as_users_run_it(tmp_path: Path):
    pytest.importorskip("ray")
    cli = Path(sys.executable).with_name("pdserve-loadtest")
    n = 60
    out = subprocess.run([str(cli), "soak", "-n", str(n), "--rate", "4", "--warmup", "8", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, check=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    lines = out.stdout.splitlines()  # Ray's raylet may print a line about the killed worker before the report
    printed = json.loads("\n".join(lines[lines.index("{"):]))
    assert printed == {**summary, "leaks": {k: v for k, v in summary["leaks"].items() if k != "series"}}
    assert out.returncode == 0, (summary["checks"], summary["unaccounted_examples"], out.stderr[-3000:])
    a = summary["accounting"]
    assert a["unaccounted"] == 0 and summary["warmup"]["unaccounted"] == 0
    assert a["completed"] + a["failed_clean"] + a["rejected_bad_input"] + a["disconnected"] == a["total"] == n
    assert a["completed"] > 0 and a["disconnected"] > 0
    assert a["rejected_bad_input"] == summary["planned"]["bad"] > 0  # every bad input a clean 4xx
    assert [k["role"] for k in summary["kills"]] == ["prefill", "decode"]
    assert all(k["pid"] and k["new_pid"] for k in summary["kills"])  # killed, and Serve started another
    leaks = summary["leaks"]
    assert leaks["nonzero_series"] == [] and leaks["replicas_seen"] == 4 and leaks["quiescent_after_s"] is not None
    assert {r["role"] for r in summary["rss"]["replicas"]} == {"router", "prefill", "decode"}
    assert summary["rss"]["exceeded"] == [] and len(summary["rss"]["restarted"]) == 2
    assert (tmp_path / "summary.md").read_text().startswith(f"# Soak: {n} requests")
