"""Placement at scale, simulated: the placement policies over hundreds of synthetic replicas.

    python -m pdserve.bench.placement --json [--replicas 500] [--requests 3000] ...

Ground truth: every replica has a hidden speed (a lognormal slowdown, and a share of stragglers) and
an exact state (running sequences, queued prefill tokens, free blocks) that evolves: decodes advance
at their true step time, prefill queues drain at their true rate. Requests arrive as a Poisson stream
spread over several routers (1, 2, 4, 8, 16 by default: `attainment_by_routers`); each router sees stats
polled every `poll_s` plus its own pending placements (pending.PendingPlacements, as the router uses
it); the other routers' placements since the poll only with `--sync-delay-s` (placement sync, each
placement heard that long after it is made).

The oracle is the slo_aware objective with exact, instant state and the true speeds. For every request,
in the same state, the policy's choice and the oracle's are both judged with true latencies: SLO
attainment, TTFT/TPOT, and the regret (policy minus oracle). Decision time is the wall time of one
`place()` call on this machine (`view_ms`: building the snapshots with pending placements). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel, TransferModel
from pdserve.placement.pending import PendingPlacements
from pdserve.placement.policy import (
    Placement, PlacementConfig, PlacementRequest, Rejection, ReplicaSnapshot, create_policy,
)
from pdserve.placement.slo_aware import SloAware

BLOCK = 16


def h100_8b_profile() -> LatencyProfile:
    """A roofline-shaped profile of an 8B Llama on one H100 (989 TFLOP/s bf16, 3.35 TB/s), KV over UCX/RDMA."""
    model = LatencyModel(
        prefill=PrefillModel(a=0.004, b=2.0e-5, c=2.0e-10),
        decode=DecodeModel(a=0.0048, b=1.0e-5, c=131072 / 3.35e12),
        kv_bytes_per_token=131072,
        transfers={"ucx": TransferModel(latency_s=1e-4, bandwidth_bytes_s=25e9)},
    )
    return LatencyProfile({"default": model}, command="synthetic: pdserve.bench.placement")


@dataclass
class Replica:
    replica_id: str
    role: str
    speed: float  # true slowdown (1.0: as the profile predicts)
    total_blocks: int
    queue: list[float] = field(default_factory=list)  # prompt tokens left per waiting prefill, FIFO
    seqs: list[list[float]] = field(default_factory=list)  # [context tokens, tokens left]

    @property
    def queued(self) -> float:
        return sum(self.queue)

    @property
    def used_blocks(self) -> int:
        return sum(math.ceil((c + left) / BLOCK) for c, left in self.seqs) + math.ceil(self.queued / BLOCK)

    def snapshot(self, model: LatencyModel, age_s: float) -> ReplicaSnapshot:
        context = int(sum(c for c, _ in self.seqs))
        batch = len(self.seqs)
        step = model.decode_step_s(batch, context) if self.role == "decode" and batch else model.prefill_time_s(2048)
        return ReplicaSnapshot(
            self.replica_id, self.role, age_s, num_running=batch, num_waiting=len(self.queue),
            queued_prefill_tokens=int(self.queued), num_free_blocks=max(0, self.total_blocks - self.used_blocks),
            num_total_blocks=self.total_blocks, block_size=BLOCK, recent_step_time_s=self.speed * step,
            recent_step_tokens=float(batch if self.role == "decode" and batch else 2048), num_context_tokens=context)

    def advance(self, model: LatencyModel, dt: float) -> None:
        budget = dt * 2048 / (self.speed * model.prefill_time_s(2048))  # prefill tokens done in dt
        while self.queue and budget > 0:
            done = min(budget, self.queue[0])
            self.queue[0] -= done
            budget -= done
            if self.queue[0] <= 0:
                self.queue.pop(0)
        if self.seqs:
            steps = dt / (self.speed * model.decode_step_s(len(self.seqs), int(sum(c for c, _ in self.seqs))))
            for s in self.seqs:
                s[0] += min(steps, s[1])
                s[1] -= steps
            self.seqs = [s for s in self.seqs if s[1] > 0]


def make_cluster(rng: random.Random, num_prefill: int, num_decode: int, straggler_share: float,
                 total_blocks: int) -> list[Replica]:
    replicas = []
    for role, n in (("prefill", num_prefill), ("decode", num_decode)):
        for i in range(n):
            speed = rng.lognormvariate(0.0, 0.1) * (2.5 if rng.random() < straggler_share else 1.0)
            replicas.append(Replica(f"{role}-{i:04d}", role, speed, total_blocks))
    return replicas


def true_outcome(judge: SloAware, request: PlacementRequest, exact: dict[str, ReplicaSnapshot],
                 placement: Placement) -> tuple[float, float]:
    """(TTFT, TPOT) of a placement with exact state and true speeds."""
    model = judge.decode_model
    (d,) = judge._options(request, [exact[placement.decode_replica]], model)
    tpot = judge.tpot_s(request, d)
    if placement.prefill_replica is None:
        decodes = d.replica.num_running
        chunk, _ = judge.chunk_budget(request, d, model, decodes)
        return judge.prefill_s(request, d, model, chunk, decodes), tpot
    (p,) = judge._options(request, [exact[placement.prefill_replica]], judge.prefill_model)
    chunk, _ = judge.chunk_budget(request, p, judge.prefill_model, 0)
    transfer = judge.prefill_model.kv_transfer_s(request.num_prompt_tokens, "ucx")
    return judge.prefill_s(request, p, judge.prefill_model, chunk, 0) + transfer, tpot


def run_policy(name: str, args: argparse.Namespace, profile: LatencyProfile) -> dict:
    rng = random.Random(args.seed)
    model = profile.for_role("decode")
    cluster = make_cluster(rng, args.prefill, args.decode, args.straggler_share, args.blocks)
    for r in cluster:  # a loaded start: a typical batch per decode replica, a short queue per prefill replica
        if r.role == "decode":
            r.seqs = [[rng.uniform(0.5, 1.5) * args.prompt_tokens, rng.uniform(1, args.output_tokens)]
                      for _ in range(rng.randint(args.initial_batch // 2, args.initial_batch))]
        else:
            r.queue = [rng.uniform(0.5, 1.5) * args.prompt_tokens for _ in range(rng.randint(0, 2))]
    by_id = {r.replica_id: r for r in cluster}
    config = PlacementConfig(policy=name, admission="queue", transport="ucx",
                             **({} if args.choice_tolerance is None else {"choice_tolerance": args.choice_tolerance}))
    routers = [create_policy(config.model_copy(update={"seed": args.seed * 1000 + k}), profile)
               for k in range(args.num_routers)]
    judge = SloAware(PlacementConfig(admission="queue", transport="ucx", choice_tolerance=0.0), profile)
    clock = [0.0]
    pendings = [PendingPlacements(grace_s=0.0, clock=lambda: clock[0]) for _ in routers]
    polled: list[ReplicaSnapshot] = []
    next_poll = last_poll = 0.0
    inbox: deque[tuple[float, int, list[tuple[str, int, int]], float]] = deque()  # placement sync in flight
    view_s, decision_s, met, met_oracle, ttft_regret, tpot_regret, ttfts, tpots = [], [], 0, 0, [], [], [], []
    for i in range(args.requests):
        dt = rng.expovariate(args.rate)
        for r in cluster:
            r.advance(model, dt)
        clock[0] += dt
        if clock[0] >= next_poll:  # every router polls every replica; what they placed before is now in the stats
            polled = [r.snapshot(model, 0.0) for r in cluster]
            for pending in pendings:
                for r in cluster:
                    pending.observe(r.replica_id, clock[0])
            next_poll, last_poll = clock[0] + args.poll_s, clock[0]
        while inbox and inbox[0][0] <= clock[0]:  # what the other routers placed reaches this one's view
            _, sender, entries, placed_at = inbox.popleft()
            if placed_at > last_poll:  # else the polled stats already show it (as placer.py drops it)
                for j, pending in enumerate(pendings):
                    if j != sender:
                        for replica, prefill_tokens, blocks in entries:
                            pending.record(replica, prefill_tokens, blocks, placed_at)
        k = i % len(routers)
        prompt = max(BLOCK, int(rng.lognormvariate(math.log(args.prompt_tokens) - 0.125, 0.5)))
        request = PlacementRequest(prompt, args.output_tokens, args.ttft_s, args.tpot_s)
        t0 = time.perf_counter()
        view = [pendings[k].apply(s) for s in polled]  # what placer.py does for every request
        prefill, decode = [s for s in view if s.role == "prefill"], [s for s in view if s.role == "decode"]
        t1 = time.perf_counter()
        placement = routers[k].place(request, prefill, decode)
        decision_s.append(time.perf_counter() - t1)
        view_s.append(t1 - t0)
        assert not isinstance(placement, Rejection)
        exact = {r.replica_id: r.snapshot(model, 0.0) for r in cluster}
        oracle = judge.place(request, [s for s in exact.values() if s.role == "prefill"],
                             [s for s in exact.values() if s.role == "decode"])
        ttft, tpot = true_outcome(judge, request, exact, placement)
        o_ttft, o_tpot = true_outcome(judge, request, exact, oracle)
        met += ttft <= args.ttft_s and tpot <= args.tpot_s
        met_oracle += o_ttft <= args.ttft_s and o_tpot <= args.tpot_s
        ttfts.append(ttft)
        tpots.append(tpot)
        ttft_regret.append(ttft - o_ttft)
        tpot_regret.append(tpot - o_tpot)
        # the request lands in the true state, and in this router's pending placements
        by_id[placement.decode_replica].seqs.append([float(prompt), float(args.output_tokens)])
        by_id[placement.prefill_replica or placement.decode_replica].queue.append(float(prompt))
        entries = pendings[k].record_placement(placement, request, BLOCK)
        if args.sync_delay_s is not None and len(routers) > 1:
            inbox.append((clock[0] + args.sync_delay_s, k, entries, clock[0]))
    n = args.requests
    return {
        "decision_ms": _dist([x * 1e3 for x in decision_s]),  # place() alone
        "view_ms": _dist([x * 1e3 for x in view_s]),  # the snapshots with pending placements applied
        "slo_attainment": met / n, "oracle_slo_attainment": met_oracle / n,
        "attainment_vs_oracle": (met / met_oracle) if met_oracle else None,
        "ttft_s": _dist(ttfts), "tpot_s": _dist(tpots),
        "ttft_regret_s": _dist(ttft_regret), "tpot_regret_s": _dist(tpot_regret),
    }


def _dist(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"mean": statistics.fmean(xs), "p50": xs[len(xs) // 2], "p99": xs[min(len(xs) - 1, int(0.99 * len(xs)))]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench placement", description=__doc__.splitlines()[0])
    p.add_argument("--prefill", type=int, default=270, help="prefill replicas (chat plan 21:18 of 500)")
    p.add_argument("--decode", type=int, default=230)
    p.add_argument("--policies", default="round_robin,least_loaded,slo_aware")
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--rate", type=float, default=6000.0, help="requests/s over the whole cluster")
    p.add_argument("--routers", default="1,2,4,8,16", help="router counts to simulate, comma-separated")
    p.add_argument("--poll-s", type=float, default=0.1)
    p.add_argument("--sync-delay-s", type=float, default=None,
                   help="routers share their placements (router.placement_sync), each heard this long after it "
                        "is made; default: no sharing, each router knows only its own placements since the poll")
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--output-tokens", type=int, default=250)
    p.add_argument("--initial-batch", type=int, default=48)
    p.add_argument("--blocks", type=int, default=29205, help="KV blocks per replica (8B bf16 on 80 GiB: 467k tokens)")
    p.add_argument("--straggler-share", type=float, default=0.05)
    p.add_argument("--ttft-s", type=float, default=0.5)
    p.add_argument("--tpot-s", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--choice-tolerance", type=float, default=None,
                   help="the policies' placement.choice_tolerance (default: the config's default)")
    p.add_argument("--json", action="store_true", help="(the output is always one JSON object)")
    args = p.parse_args(argv)
    try:
        counts = [int(n) for n in str(args.routers).split(",")]
    except ValueError:
        p.error(f"--routers: comma-separated router counts, got {args.routers!r}")
    if any(n < 1 for n in counts):
        p.error("--routers: every router count is at least 1")
    if args.sync_delay_s is not None and args.sync_delay_s < 0:
        p.error("--sync-delay-s: at least 0")
    profile = h100_8b_profile()
    result = {"command": "python -m pdserve.bench.placement " + " ".join(argv or sys.argv[1:]),
              "replicas": {"prefill": args.prefill, "decode": args.decode}, "routers": counts,
              "rate_rps": args.rate, "requests": args.requests, "sync_delay_s": args.sync_delay_s,
              "slo": {"ttft_s": args.ttft_s, "tpot_s": args.tpot_s},
              "attainment_by_routers": {}, "decision_ms_p50_by_routers": {}, "by_routers": {}}
    for n in counts:
        args.num_routers = n
        runs = {name: run_policy(name, args, profile) for name in args.policies.split(",")}
        result["by_routers"][str(n)] = runs
        attainment = {name: round(r["slo_attainment"], 4) for name, r in runs.items()}
        oracles = [r["oracle_slo_attainment"] for r in runs.values()]  # each in the state its policy made
        attainment["oracle"] = round(statistics.fmean(oracles), 4) if oracles else None
        result["attainment_by_routers"][str(n)] = attainment
        result["decision_ms_p50_by_routers"][str(n)] = {
            name: round(r["decision_ms"]["p50"] + r["view_ms"]["p50"], 4) for name, r in runs.items()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
