"""The most goodput a disaggregated target's prefill pool allows, from its live reports, before any decode.

A request's TTFT is at least its wait in its prefill replica's queue plus its own prefill. Here each prompt
is prefilled at the speed the report's machine check measured on an idle engine (the profile's prefill
scaled by `prefill_1024`'s ratio; no load makes a step faster), in arrival order (as the engine admits
them), on the prefill replica free soonest, with no decode, transfer, serving layer or shared cores. TTFT
within the SLO is then an upper bound on the target's attainment at every rate, for the same requests, and
so on its goodput read at the crossing (`goodput_ratio.crossing`: attainment lower at every rate of the same
grid never crosses later). Dividing by the other targets' measured goodputs gives the largest goodput ratio
the target's runs could have read. With one prefill replica (the committed scenario) that holds for any
placement; with several, each request goes to the replica free soonest, which a live placer can match but
is not proven to be unbeatable.

Two readings, at the report's SLO:

- `grid`: the requests each live point sent (the scenario's seed and count), at the report's rates;
- `steady`: `steady_requests` requests in each of `draws` seeded draws at `rates` (default: the grid and on
  up to twice its top), their mean attainment: what longer runs, or a grid reaching further, approach.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.latency_model import LatencyProfile
from pdserve.loadtest.goodput_ratio import crossing
from pdserve.loadtest.runner import LoadConfig
from pdserve.loadtest.workloads import Workload, workload
from pdserve.sim.calibrate import scales_from_machine
from pdserve.sim.config import SimRequest
from pdserve.sim.scenario import load_profile
from pdserve.sim.workload import requests_for

BLOCK = 16  # prompts' block hashes play no part here


def fifo_ttfts(requests: Sequence[SimRequest], prefill_s: Sequence[float], num_replicas: int) -> list[float]:
    """Each request's TTFT in arrival order, on the replica free soonest; `prefill_s[i]` is request i's."""
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    free = [0.0] * num_replicas  # a heap of the replicas' next free times
    out = []
    for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival_s):
        arrival = requests[i].arrival_s
        done = max(heapq.heappop(free), arrival) + prefill_s[i]
        heapq.heappush(free, done)
        out.append(done - arrival)
    return out


def attainment(requests: Sequence[SimRequest], profile: LatencyProfile, scale: float, num_replicas: int,
               ttft_slo_s: float) -> float:
    model = profile.for_role("prefill")
    ttfts = fifo_ttfts(requests, [scale * model.prefill_time_s(r.prompt_tokens) for r in requests], num_replicas)
    return sum(t <= ttft_slo_s for t in ttfts) / len(ttfts) if ttfts else 1.0


def _target(report: Mapping[str, Any], name: str | None) -> Mapping[str, Any]:
    targets = report["targets"]
    if name is None:
        found = [t for t in targets if t["system"].get("mode") == "disaggregated"]
        if not found:
            raise ValueError(f"report {report.get('scenario')!r} has no disaggregated target")
        return found[0]
    for t in targets:
        if t["name"] == name:
            return t
    raise ValueError(f"report {report.get('scenario')!r} has no target {name!r}")


def _goodput(points: Sequence[tuple[float, float]], goal: float) -> dict[str, Any]:
    g = crossing(points, goal)
    return {"rps": g.rps, "bound": g.bound}


class ReportBound:
    """One live report's prefill-pool bound for its disaggregated target."""

    def __init__(self, report: Mapping[str, Any], profile: LatencyProfile, seed: int, target: str | None = None):
        self.report, self.profile, self.seed = report, profile, seed
        self.target = _target(report, target)
        checks = self.target.get("machine") or report.get("machine")
        if not checks:
            raise ValueError(f"report {report.get('scenario')!r} has no machine check to time prefill by")
        self.scale = scales_from_machine(checks[0], profile)[0]
        self.num_prefill = int((self.target["system"].get("prefill") or {}).get("num_replicas", 1))
        self.work: Workload = workload(report["workload"])
        self.ttft_slo_s = report["slo"]["ttft_ms"] / 1e3
        self.goal = float(report["sweep"].get("target", 0.9))
        self.rates = sorted(float(r) for r in report["sweep"]["rates"])
        ld = report["load"]
        self.load = LoadConfig(int(ld["num_requests"]), float(ld["max_duration_s"]), ld["arrival"],
                               float(ld.get("burstiness", 1.0)), seed)

    def at(self, requests: Sequence[SimRequest]) -> float:
        return attainment(requests, self.profile, self.scale, self.num_prefill, self.ttft_slo_s)

    def grid(self) -> dict[str, Any]:
        """The live points' own requests at the report's rates, beside what the target measured there."""
        points = [(r, self.at(requests_for(self.work, self.load, r, BLOCK))) for r in self.rates]
        measured = [(p["rate"], p["attainment"]) for p in self.target["points"]]
        others = {t["name"]: _goodput([(p["rate"], p["attainment"]) for p in t["points"]], self.goal)
                  for t in self.report["targets"] if t is not self.target}
        bound = _goodput(points, self.goal)
        return {
            "prefill_scale": self.scale, "attainment": {f"{r:g}": a for r, a in points},
            "measured_attainment": {f"{r:g}": a for r, a in measured}, "goodput_bound": bound,
            "measured_goodput": _goodput(measured, self.goal), "others_measured_goodput": others,
            "max_ratio": {name: bound["rps"] / g["rps"] for name, g in others.items() if g["rps"] > 0},
        }

    def steady(self, rates: Sequence[float], num_requests: int, draws: int) -> dict[str, Any]:
        points = []
        for rate in rates:
            runs = [self.at(requests_for(self.work, LoadConfig(num_requests, 1e9, self.load.arrival,
                                                               self.load.burstiness, self.seed + k), rate, BLOCK))
                    for k in range(draws)]
            points.append((rate, statistics.fmean(runs), min(runs), max(runs)))
        return {"requests": num_requests, "draws": draws,
                "attainment": {f"{r:g}": {"mean": m, "min": lo, "max": hi} for r, m, lo, hi in points},
                "goodput_bound": _goodput([(r, m) for r, m, _, _ in points], self.goal)}


def prefill_bound_main(results: Path, target: str | None = None, steady_requests: int = 500, draws: int = 20,
                       rates: Sequence[float] | None = None) -> dict[str, Any]:
    """Every report of `results` (run-*/summary.json, else summary.json): its grid bound; and the steady
    bound at the fastest machine check among them (the most generous)."""
    from pdserve.loadtest.validate import _profile_path, load_scenario
    from pdserve.loadtest.validation_runs import load_reports

    if steady_requests < 1 or draws < 1:
        raise ValueError("steady requests and draws must be >= 1")
    bounds = []
    for path, report in load_reports(results):
        try:
            scenario = load_scenario(report["scenario"])
            bounds.append((path, ReportBound(report, load_profile(_profile_path(scenario, report)), scenario.seed,
                                             target)))
        except KeyError as exc:
            raise ValueError(f"{path}: a report lacks {exc}") from None
    fastest = min(bounds, key=lambda b: b[1].scale)[1]
    top = fastest.rates[-1]
    steady_rates = sorted(set(rates or [*fastest.rates, *(top * (1 + k / 4) for k in range(1, 5))]))
    return {
        "target": fastest.target["name"], "num_prefill": fastest.num_prefill,
        "ttft_slo_ms": fastest.ttft_slo_s * 1e3, "goal": fastest.goal,
        "runs": {str(p): b.grid() for p, b in bounds},
        "steady": {"prefill_scale": fastest.scale, **fastest.steady(steady_rates, steady_requests, draws)},
    }
