"""`pdserve-loadtest prefill-bound` (pdserve.loadtest.prefill_bound): the FIFO prefill queue against closed
forms, and the bound against the committed live runs it bounds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pdserve.loadtest.prefill_bound import fifo_ttfts
from pdserve.sim.config import SimRequest

REPO = Path(__file__).resolve().parents[2]
FIXED = REPO / "loadtest/results/disagg-vs-colocated-fixed"


def _requests(arrivals: list[float]) -> list[SimRequest]:
    return [SimRequest(i, t, 100, 10) for i, t in enumerate(arrivals)]


def test_an_overloaded_replica_queues_linearly_and_two_keep_up():
    # D/D/1 with arrivals every 0.5 s and 1 s prefills: request k waits 0.5 k, so its TTFT is 1 + 0.5 k
    requests = _requests([0.5 * k for k in range(6)])
    assert fifo_ttfts(requests, [1.0] * 6, 1) == pytest.approx([1 + 0.5 * k for k in range(6)])
    assert fifo_ttfts(requests, [1.0] * 6, 2) == pytest.approx([1.0] * 6)  # alternating: nobody waits


def test_requests_are_served_in_arrival_order_whatever_their_order_given():
    requests = _requests([2.0, 0.0, 1.0])
    # arrival order is 1 (t=0), 2 (t=1), 0 (t=2), with prefills of 3, 1 and 2 s: done at 3, 4, 6
    assert fifo_ttfts(requests, [2.0, 3.0, 1.0], 1) == pytest.approx([3.0, 3.0, 4.0])


def test_no_replica_is_refused():
    with pytest.raises(ValueError, match="num_replicas"):
        fifo_ttfts(_requests([0.0]), [1.0], 0)


def test_the_bound_holds_against_the_committed_live_runs():
    out = subprocess.run([Path(sys.executable).with_name("pdserve-loadtest"), "prefill-bound", str(FIXED), "--json",
                          "--steady-requests", "200", "--draws", "4"], capture_output=True, text=True, cwd=REPO,
                         check=True)
    got = json.loads(out.stdout)
    assert got["target"] == "disaggregated" and got["num_prefill"] == 1 and len(got["runs"]) >= 3
    for run in got["runs"].values():
        for rate, measured in run["measured_attainment"].items():  # a live run never beats its prefill queue
            assert measured <= run["attainment"][rate] + 1e-9
        assert run["measured_goodput"]["rps"] <= run["goodput_bound"]["rps"] + 1e-9
        for name, ratio in run["max_ratio"].items():
            assert ratio == pytest.approx(run["goodput_bound"]["rps"] / run["others_measured_goodput"][name]["rps"])
    steady = got["steady"]["attainment"]
    means = [steady[r]["mean"] for r in sorted(steady, key=float)]
    assert means[0] >= got["goal"] > means[-1]  # the steady reading crosses within its rates (to twice the grid's top)
    assert got["steady"]["goodput_bound"]["bound"] == "exact"


@pytest.mark.parametrize("args, message", [
    (["prefill-bound", "/nonexistent-results"], "no summary.json"),
    (["prefill-bound", str(FIXED), "--target", "nope"], "no target 'nope'"),
    (["prefill-bound", str(REPO / "loadtest/results/prefix-routing-fixed")], "no disaggregated target"),
    (["prefill-bound", str(FIXED), "--draws", "0"], "draws must be >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    out = subprocess.run([sys.executable, "-m", "pdserve.loadtest.cli", *args], capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert "Traceback" not in out.stderr
