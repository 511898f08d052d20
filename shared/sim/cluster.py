"""The discrete-event loop: arrivals, routers polling stats and placing with the live placement code,
engine steps, KV handoffs, and (optionally) an autoscaler adding and draining replicas.

Routers: request i goes to router i mod n. Each router polls every replica's stats every poll_s (the
routers' polls are staggered over the period, at `poll_phase` against the arrivals) and places with
`create_policy` on those snapshots plus its own pending placements (pdserve.placement.pending, as the
live placer does). Disaggregated: the request queues on its prefill replica (in chunks of a KV part where
the router hands the KV over in parts, pdserve.sim.handoff); when its prompt is done its first token reaches
the client, what is left of its KV moves for `kv_transfer_s` (its prefill blocks held until then), and it
joins the decode replica. Without a prefill replica in the placement, the decode replica prefills it locally.
A draining replica takes no new placement and leaves once it holds no work (nothing is lost).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.latency_model import LatencyProfile
from pdserve.placement.pending import PendingPlacements
from pdserve.placement.policy import PlacementRequest, Rejection, create_policy
from pdserve.sim.config import ClusterSpec, SimRequest
from pdserve.sim.engine import Batch, Engine, SimSeq
from pdserve.sim.handoff import plan_handoff
from pdserve.sim.host import OffStepLoad, SharedCores
from pdserve.sim.replica import Replica
from pdserve.sim.results import RequestRecord
from pdserve.sim.steps import summed

# event priorities at equal times: replicas come up and steps end before polls, polls before arrivals
READY, STEP, TRANSFER, POLL, SCALE, ARRIVAL = range(6)
STALL_S = 3600.0  # simulated seconds without a step, handoff or arrival while requests remain: a bug


class Scaler(Protocol):
    interval_s: float

    def desired(self, sim: Simulation, now: float) -> dict[str, int]:
        """Desired ready (or starting) replicas per role."""


@dataclass
class Observers:
    on_arrival: list[Callable[[RequestRecord, float], None]] = field(default_factory=list)
    on_finish: list[Callable[[RequestRecord, float], None]] = field(default_factory=list)


class Simulation:
    def __init__(self, spec: ClusterSpec, profile: LatencyProfile, requests: Sequence[SimRequest],
                 scaler: Scaler | None = None, placement_profile: LatencyProfile | None = None) -> None:
        """`placement_profile`: the profile file the routers read (default `profile`, the engines' timing);
        a live router predicts from its file even where the machine runs slower."""
        self.spec, self.profile, self.scaler = spec, profile, scaler
        self.records = [RequestRecord(r) for r in sorted(requests, key=lambda r: r.arrival_s)]
        self.replicas: list[Replica] = []
        self.retired: list[Replica] = []
        self.observers = Observers()
        self.now = 0.0
        self._events: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._ids = {"prefill": itertools.count(), "decode": itertools.count()}
        self._records_by_seq: dict[int, RequestRecord] = {}
        # prefilling sequence -> (its decode replica, the tokens whose KV is left to move after its prefill)
        self._targets: dict[int, tuple[Replica, int]] = {}
        colocated = spec.mode == "colocated"
        router = spec.router
        prefill_model = profile.for_role("prefill")
        self.transfer_model = prefill_model if spec.transport in prefill_model.transfers else None
        placement = router.placement
        placement_profile = (placement_profile or profile) if router.has_profile else None
        if placement.transport is not None and placement.transport not in prefill_model.transfers:
            placement = placement.model_copy(update={"transport": None})
        if placement.policy == "slo_aware" and placement_profile is None:
            placement = placement.model_copy(update={"policy": "least_loaded"})
        self.policies = [create_policy(placement.model_copy(update={"seed": (placement.seed or 0) * 1000 + k}),
                                       placement_profile, has_prefill_pool=not colocated)
                         for k in range(router.num_routers)]
        self.pendings = [PendingPlacements(router.pending_grace_s, clock=lambda: self.now)
                         for _ in range(router.num_routers)]
        self.polled: list[list] = [[] for _ in range(router.num_routers)]
        self.with_prefixes = any(r.block_hashes for r in requests)
        self._round_robin = itertools.count()
        self.off_step = OffStepLoad(spec.off_step_cpu_token_s + spec.serving_cpu_token_s)
        continuous = spec.num_cores is not None and spec.core_sharing == "continuous"
        self.cores = SharedCores(spec.num_cores) if continuous else None  # type: ignore[arg-type]
        for role, n in (("prefill", 0 if colocated else spec.num_prefill), ("decode", spec.num_decode)):
            for _ in range(n):
                self.add_replica(role, 0.0, 0.0)

    # --- replicas ----------------------------------------------------------------------------------

    def add_replica(self, role: str, now: float, startup_s: float) -> Replica:
        engine_role = "colocated" if self.spec.mode == "colocated" else role
        spec = self.spec.prefill if role == "prefill" else self.spec.decode
        name = f"{role}-{next(self._ids[role]):03d}"
        replica = Replica(Engine(name, engine_role, spec, self.profile.for_role(role)), role, now, now + startup_s)
        self.replicas.append(replica)
        if startup_s > 0:
            self._push(replica.ready_s, READY, replica)
        return replica

    def active(self, role: str) -> list[Replica]:
        """Replicas of `role` that are up or starting and not draining: what the autoscaler counts."""
        return [r for r in self.replicas if r.role == role and not r.is_draining]

    def drain(self, replica: Replica) -> None:
        replica.is_draining = True
        self._retire_if_empty(replica)

    def _retire_if_empty(self, replica: Replica) -> None:
        if replica.is_draining and replica.is_empty and replica in self.replicas:
            replica.stopped_s = self.now
            self.replicas.remove(replica)
            self.retired.append(replica)

    def _placeable(self, role: str) -> list[Replica]:
        return [r for r in self.replicas if r.role == role and not r.is_draining and r.ready_s <= self.now]

    # --- the loop ----------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._events, (t, kind, next(self._seq), payload))

    def run(self) -> list[RequestRecord]:
        for record in self.records:
            self._push(record.request.arrival_s, ARRIVAL, record)
        period, phase = self.spec.router.poll_s, self.spec.router.poll_phase
        for k in range(len(self.policies)):
            first = (k + phase) * period / len(self.policies)
            if first > 0:
                self._poll(k)  # its previous poll, of the idle system: live routers poll from start-up
            self._push(first, POLL, k)
        if self.scaler is not None:
            self._push(self.scaler.interval_s, SCALE, None)
        remaining, last_work = len(self.records), 0.0
        while self._events and remaining:
            t, kind, _, payload = heapq.heappop(self._events)
            self.now = t
            if kind in (ARRIVAL, STEP, TRANSFER):
                last_work = t
            elif t - last_work > STALL_S:
                raise RuntimeError(f"simulation stalled at t={t:.1f} s with {remaining} requests unfinished")
            if kind == ARRIVAL:
                remaining -= self._arrive(payload)  # type: ignore[arg-type]
            elif kind == STEP:
                remaining -= self._step_done(payload)  # type: ignore[arg-type]
            elif kind == TRANSFER:
                remaining -= self._handoff_done(*payload)  # type: ignore[misc]
            elif kind == POLL:
                self._poll(payload)  # type: ignore[arg-type]
                self._push(t + period, POLL, payload)
            elif kind == SCALE:
                self._scale()
                self._push(t + self.scaler.interval_s, SCALE, None)  # type: ignore[union-attr]
            elif kind == READY:
                self._kick(payload)  # type: ignore[arg-type]
        for replica in self.replicas:
            replica.stopped_s = self.now
        return self.records

    def _poll(self, k: int) -> None:
        pending = self.pendings[k]
        self.polled[k] = [r.engine.snapshot(r.role, 0.0, self.with_prefixes)
                          for r in self.replicas if r.ready_s <= self.now]
        for snapshot in self.polled[k]:
            pending.observe(snapshot.replica_id, self.now)

    def _arrive(self, record: RequestRecord) -> int:
        """1 when the request is rejected (done), else 0."""
        for hook in self.observers.on_arrival:
            hook(record, self.now)
        req, router = record.request, self.spec.router
        k = req.index % len(self.policies)
        by_id = {r.replica_id: r for r in self.replicas}
        view = [self.pendings[k].apply(s) for s in self.polled[k]
                if s.replica_id in by_id and not by_id[s.replica_id].is_draining]
        request = PlacementRequest(req.prompt_tokens, req.output_tokens, router.ttft_slo_s, router.tpot_slo_s,
                                   block_hashes=req.block_hashes)
        placement = self.policies[k].place(request, [s for s in view if s.role == "prefill"],
                                           [s for s in view if s.role == "decode"])
        if isinstance(placement, Rejection) or not self._fits(req):
            record.status = "rejected"
            for hook in self.observers.on_finish:
                hook(record, self.now)
            return 1
        decode = by_id.get(placement.decode_replica or "") or self._pick("decode")
        record.decode_replica = decode.replica_id
        prefill = None
        if placement.disaggregate and self.spec.mode == "disaggregated":
            prefill = by_id.get(placement.prefill_replica or "") or self._pick("prefill")
        self.pendings[k].record_placement(placement, request, decode.engine.spec.block_size, req.index)
        seq_owner = prefill or decode
        handoff = plan_handoff(router.kv_part_tokens if prefill else None, placement.prefill_chunk_tokens,
                               placement.decode_replica is not None, req.prompt_tokens,
                               seq_owner.engine.spec.block_size)
        seq = seq_owner.engine.add(req, handoff.max_prefill_chunk)
        self._records_by_seq[id(seq)] = record
        if prefill is not None:
            record.prefill_replica = prefill.replica_id
            self._targets[id(seq)] = (decode, handoff.tail_tokens(req.prompt_tokens))
            decode.num_inbound += 1
        self._kick(seq_owner)
        return 0

    def _fits(self, req: SimRequest) -> bool:
        """Whether a replica's whole pool can hold the request (the engine would never admit it otherwise)."""
        decode, prefill = self.spec.decode, self.spec.prefill
        if req.prompt_tokens + req.output_tokens > decode.num_blocks * decode.block_size:
            return False
        return self.spec.mode == "colocated" or req.prompt_tokens <= prefill.num_blocks * prefill.block_size

    def _pick(self, role: str) -> Replica:
        """Serve's choice when the placement names no replica (no stats yet): round robin."""
        pool = self._placeable(role) or [r for r in self.replicas if r.role == role]
        return pool[next(self._round_robin) % len(pool)]

    def _kick(self, replica: Replica) -> None:
        """Starts a step on an idle, ready engine that has work."""
        engine = replica.engine
        if engine.busy_until is not None or replica.ready_s > self.now or not engine.has_work:
            return
        batch = engine.schedule()
        if not batch.decodes and not batch.prefills:
            return  # waits for blocks: a handoff or a finish frees them and kicks it again
        profiled = engine.step_time_s(batch)
        replica.step_cpu = profiled * self._threads(replica)
        replica.cpu_s += replica.step_cpu
        replica.batch, replica.step_start = batch, self.now
        if self.cores is None:
            slowdown = self._sharing(replica, batch)
            engine.busy_until = self.now + self.spec.wake_wait_s * (1.0 - 1.0 / slowdown) + profiled * slowdown
            replica.step_version += 1
            self._push(engine.busy_until, STEP, (replica, replica.step_version))
        else:
            engine.busy_until = self.now  # in flight; its end comes from the sharing
            self.cores.start(replica, profiled, self._threads(replica), self.now, self.spec.wake_wait_s)
            self._reshare()

    def _reshare(self) -> None:
        """Every step in flight gets its end at the rate the host's demand now leaves it."""
        other = self.off_step.cores(self.now) + self.spec.background_cores
        for replica, end in self.cores.reshare(self.now, other).items():  # type: ignore[union-attr]
            replica.engine.busy_until = end
            replica.step_version += 1
            self._push(end, STEP, (replica, replica.step_version))

    def _sharing(self, replica: Replica, batch: Batch) -> float:
        """Slow-down of a step starting now on a shared host: the threads of every busy replica (this one
        included) over its cores, fixed for the step's length; over-subscribed, times the measured scale."""
        cores = self.spec.num_cores
        if cores is None:
            return 1.0
        busy = sum(self._threads(r) for r in self.replicas if r is replica or r.engine.busy_until is not None)
        fair = max(1.0, (busy + self.off_step.cores(self.now) + self.spec.background_cores) / cores)
        if busy <= cores:
            return fair
        prefill_scale, decode_scale = self.spec.oversubscribed_scale
        return fair * (prefill_scale if batch.prefills else decode_scale)

    def _threads(self, replica: Replica) -> float:
        cores = self.spec.num_cores
        return replica.engine.spec.num_threads if cores is None else min(replica.engine.spec.num_threads, cores)

    def _step_done(self, payload: tuple[Replica, int]) -> int:
        replica, version = payload
        if version != replica.step_version:
            return 0  # its end moved since (shared cores)
        engine, batch = replica.engine, replica.batch
        engine.busy_until, replica.batch = None, None
        if self.cores is not None:
            self.cores.finish(replica, self.now)
        outcome = engine.complete(batch, self.now, self.now - replica.step_start)  # type: ignore[arg-type]
        replica.steps.add(self.now - replica.step_start, replica.step_cpu, bool(batch.prefills))  # type: ignore[union-attr]
        self.off_step.add(self.now, outcome.num_tokens)
        replica.cpu_s += outcome.num_tokens * self.spec.off_step_cpu_token_s
        for seq in outcome.prefilled:
            replica.num_held += 1
            seq.first_token_s = self._records_by_seq[id(seq)].first_token_s = self.now
            tokens = self._targets[id(seq)][1]
            transfer = self.transfer_model.kv_transfer_s(tokens, self.spec.transport) if self.transfer_model else 0.0
            self._push(self.now + transfer, TRANSFER, (replica, seq))
        for seq in outcome.finished:
            self._finish(seq)
        self._kick(replica)
        if self.cores is not None and replica.batch is None:
            self._reshare()  # no next step here: the others speed up
        self._retire_if_empty(replica)
        return len(outcome.finished)

    def _handoff_done(self, source: Replica, seq: SimSeq) -> int:
        source.engine.free(seq)
        source.num_held -= 1
        target, _ = self._targets.pop(id(seq))
        target.num_inbound -= 1
        done = 0
        if seq.is_finished:
            seq.finish_s = seq.first_token_s
            self._finish(seq)
            done = 1
        else:
            target.engine.add_imported(seq)
            self._kick(target)
        self._kick(source)
        self._retire_if_empty(source)
        self._retire_if_empty(target)
        return done

    def _finish(self, seq: SimSeq) -> None:
        record = self._records_by_seq.pop(id(seq))
        record.status = "ok"
        self.pendings[record.request.index % len(self.pendings)].done(record.request.index)  # as the router does
        record.first_token_s = record.first_token_s or seq.first_token_s
        record.finish_s = seq.finish_s
        record.num_preemptions = seq.num_preemptions
        record.cached_tokens, record.prefill_chunks = seq.num_cached_tokens, seq.num_prefill_chunks
        for hook in self.observers.on_finish:
            hook(record, self.now)

    def _scale(self) -> None:
        desired = self.scaler.desired(self, self.now)  # type: ignore[union-attr]
        for role, want in desired.items():
            active = self.active(role)
            for _ in range(want - len(active)):
                self.add_replica(role, self.now, self.spec.startup_s)
            if want < len(active):  # the starting ones first, then the least loaded
                victims = sorted(active, key=lambda r: (r.ready_s <= self.now, r.engine.has_work,
                                                        len(r.engine.running), r.replica_id))
                for replica in victims[: len(active) - want]:
                    self.drain(replica)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds of every role's replicas so far: their steps and their off-step work per token (what a
        live run's `replica_cpu_s` measures, less the replicas' idle work)."""
        out = {"prefill": 0.0, "decode": 0.0}
        for r in (*self.retired, *self.replicas):
            out[r.role] += r.cpu_s
        return out

    def step_seconds(self) -> dict[str, dict[str, float]]:
        """Role -> its replicas' steps so far: how many, their wall time, their CPU, and the same for the steps
        that carried prompt tokens (a live run's `engine_steps`, pdserve.engine.step_clock.StepTotals)."""
        return summed([(r.role, r.steps) for r in (*self.retired, *self.replicas)])

    def replica_seconds(self) -> dict[str, float]:
        out = {"prefill": 0.0, "decode": 0.0}
        for r in (*self.retired, *self.replicas):
            out[r.role] += (r.stopped_s if r.stopped_s is not None else self.now) - r.requested_s
        return out
