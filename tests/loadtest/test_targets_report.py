"""Loopback-only targets, the CLI's argument handling, and the report files from fabricated results."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from pdserve.loadtest.cli import length_spec, main
from pdserve.loadtest.client import RequestResult
from pdserve.loadtest.evaluate import TargetResult
from pdserve.loadtest.metrics import summarize
from pdserve.loadtest.report import write_report
from pdserve.loadtest.runner import Run
from pdserve.loadtest.scenario import Scenario
from pdserve.loadtest.slo import SLO, IdleLatency
from pdserve.loadtest.sweep import SweepResult
from pdserve.loadtest.targets import check_url, is_loopback_host


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000", "http://127.8.9.10/", "http://localhost:1", "http://LOCALHOST", "http://[::1]:8000",
    "https://127.0.0.1",
])
def test_loopback_urls_pass(url):
    assert check_url(url) == url.rstrip("/")


@pytest.mark.parametrize("url", [
    "http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000", "http://[::]:80", "http://128.0.0.1",
    "http://localhost.example.com", "http://[::ffff:8.8.8.8]",
])
def test_other_hosts_are_refused_unless_allowed(url):
    with pytest.raises(ValueError, match="allow-remote"):
        check_url(url)
    assert check_url(url, allow_remote=True) == url.rstrip("/")


def test_malformed_urls_are_refused_even_when_remote_is_allowed():
    for url in ("ftp://127.0.0.1", "127.0.0.1:8000", "http://"):
        with pytest.raises(ValueError):
            check_url(url, allow_remote=True)
    assert not is_loopback_host("not-a-host")


def test_cli_refuses_a_remote_url_before_sending_anything(capsys):
    assert main(["run", "--url", "http://192.0.2.1:8000", "--rate", "1", "--no-progress"]) == 2
    assert "allow-remote" in capsys.readouterr().err


def test_length_spec():
    assert length_spec("128") == 128
    assert length_spec("lognormal:mean=1500,std=500.5,min=64") == {"dist": "lognormal", "mean": 1500, "std": 500.5,
                                                                   "min": 64}


def test_shipped_scenarios_validate():
    from importlib.resources import files

    from pdserve.services.app import SystemConfig

    for name in ("smoke.yaml", "disagg-vs-colocated.yaml"):
        scenario = Scenario.from_yaml(files("pdserve.loadtest") / "scenarios" / name)
        assert scenario.chosen_cdf_rate in scenario.sweep.rates
        for target in scenario.targets:
            SystemConfig.model_validate({"model": "tiny", **target.system})


def fake_target(name: str, ttft: float, goodput_rate: float) -> TargetResult:
    slo = SLO(0.5, 0.05)
    result = TargetResult(name, IdleLatency(0.1, 0.01), SweepResult(), slo=slo, system={"mode": "colocated"})
    for rate in (1.0, 2.0, 4.0):
        good = rate <= goodput_rate
        results = [RequestResult(i, 10, 5, i / rate, i / rate, "ok", 200,
                                 [ttft if good else 1.0, 0.2, 0.25, 0.3], 0.3 if good else 1.3, 5) for i in range(4)]
        results.append(RequestResult(4, 10, 5, 4 / rate, None))  # cancelled
        result.runs[rate] = Run(results, 4 / rate + 0.3, summarize(results, 4 / rate + 0.3, rate), 0)
    result.sweep.points = {r: (1.0 if r <= goodput_rate else 0.0) for r in (1.0, 2.0, 4.0)}
    result.sweep.goodput = goodput_rate
    result.sweep.bracket = (goodput_rate, 4.0 if goodput_rate < 4.0 else None)
    return result


def test_report_files_and_ratios(tmp_path):
    targets = [fake_target("disagg", 0.1, 1.0), fake_target("colo", 0.1, 2.0)]
    summary = write_report(tmp_path, targets, SLO(0.5, 0.05), 2.0, 0.9, {"scenario": "t", "slo_reference": "disagg",
                                                                           "slo_spec": {"ttft_factor": 5}})
    for name in ("summary.json", "summary.md", "attainment_vs_rate.png", "latency_cdf.png", "throughput_vs_rate.png"):
        assert (tmp_path / name).stat().st_size > 0
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary))
    assert on_disk["comparison"] == {"baseline": "disagg", "winner": "colo", "winner_vs": {"disagg": 2.0}}
    assert [t["goodput_vs_baseline"] for t in on_disk["targets"]] == [1.0, 2.0]
    point = on_disk["targets"][0]["points"][0]
    assert point["summary"]["counts"]["total"] == 5 and point["summary"]["counts"]["cancelled"] == 1
    md = (tmp_path / "summary.md").read_text()
    assert "**`colo` wins** with goodput 2 req/s: 2.00× `disagg` (1 req/s)" in md
    assert "![attainment_vs_rate](attainment_vs_rate.png)" in md


def test_report_says_tie(tmp_path):
    targets = [fake_target("a", 0.1, 4.0), fake_target("b", 0.1, 4.0)]
    summary = write_report(tmp_path, targets, SLO(0.5, 0.05), 1.0, 0.9, {"scenario": "t"})
    assert summary["comparison"]["winner"] is None
    assert "Tie" in (tmp_path / "summary.md").read_text()


def test_report_header_states_commit_date_and_machine(tmp_path):
    import subprocess

    from pdserve.loadtest.provenance import provenance

    meta = {"scenario": "t", "slo_reference": "disagg", "slo_spec": {}, "provenance": provenance()}
    write_report(tmp_path, [fake_target("disagg", 0.1, 1.0)], SLO(0.5, 0.05), 2.0, 0.9, meta)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).parent).stdout.strip()
    ran = next(line for line in (tmp_path / "summary.md").read_text().splitlines() if line.startswith("- ran:"))
    assert f"commit `{head}" in ran and meta["provenance"]["date"] in ran
    assert f"({os.cpu_count()} cores" in ran
    assert json.loads((tmp_path / "summary.json").read_text())["provenance"]["host"]["cores"] == os.cpu_count()


def test_committed_reports_state_where_they_ran():
    import subprocess

    results = Path(__file__).resolve().parents[2] / "loadtest" / "results"
    reports = sorted(results.glob("*/summary.md"))
    assert {p.parent.name for p in reports} >= {"disagg-vs-colocated", "prefix-routing", "router-policies", "soak"}
    for report in reports:
        assert any(line.startswith("- ran: committed in `") or line.startswith("- ran: commit `")
                   for line in report.read_text().splitlines()), report
    tracked = subprocess.run(["git", "ls-files", "--", "*/runs/*"], capture_output=True, text=True, cwd=results).stdout
    assert tracked == "", "raw per-request records stay out of git"
