"""What the latency profile lacks about a live deployment, as explicit parameters, and their arithmetic.

A profile times one engine alone on the machine it was measured on. A live load-test run adds:

- **CPU speed**: the run's machine against the profile's (`pdserve.loadtest.machine` measures three shapes
  before each target). `prefill_scale` multiplies every prefill coefficient; the decode step
  a + b·batch + c·context scales as `decode_fixed_scale`·a + `decode_row_scale`·(b·batch + c·context),
  the two scales solved from the batch-1 and batch-8 shapes.
- **Serving layer on the TTFT path** (`serving_ttft_s`): HTTP, the Serve proxy, tokenisation, placement,
  the handoff's control messages, the first SSE event. A fixed delay per request that holds no engine: a
  delay on every arrival shifts the whole run, so it is added to each record's first-token and finish time.
- **Serving per step** (`serving_step_s`): what the replica's loop, the token streams and the relay to the
  router add to each decode step, from the target's batch probe (pdserve.loadtest.batch_probe: k requests
  decoding together, against the simulator's same k, solved so that the simulator returns the probe's TPOT). Measured on this repository's VMs it hardly grows with
  the batch (about 1.1 ms a step at k = 2, 4 and 8), so it is added to the step's fixed term `a`.
- **Serving probe** (reports that have one, pdserve.loadtest.serving_probe): short prompts one at a time, whose
  TTFT is the serving path's fixed part, `serving_ttft_s` (less the simulator's TTFT for the same request);
  then a long prompt found in the prefix cache, whose TTFT beyond that and the simulator's short prefill is
  the path's cost per prompt token, `serving_ttft_token_s`. Without the probe, the serving cost is what the
  idle probe measured beyond the machine check's scaled prefill, and a check a few percent off (minutes of
  VM drift, or the replica against the check's process) is then read as serving cost, or hides it.
- **Relay per token** (`relay_token_s`): for reports without a batch probe, the idle probe's TPOT gap, added
  to the decode step's per-row term `b` (at batch 1 it adds exactly itself to TPOT). One request alone
  streams more slowly than requests sharing steps, so under load this over-prices every row.
- **Off-step CPU per token** (`off_step_cpu_token_s`): what the replicas burn per generated token beyond the
  steps' time, which overlaps the next step at idle and takes cores under load (pdserve.sim.host); and
  what the rest of the host burns per token (`serving_cpu_token_s`: router, Serve proxy, load client) and
  all the time (`background_cores`). `CPUAccount` takes them from a report's measured CPU.

The scales and serving costs are calibrated from idle measurements only: the scales from the machine
check (an engine alone), the serving costs from the target's idle probe (one request alone) and batch probe
minus the scaled simulator's figures for the same requests. The CPU terms come from the target's lowest-rate point and its quiet
window (validate then compares the model's CPU with the measured at the other rates).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel
from pdserve.sim.config import ClusterSpec
from pdserve.sim.results import RequestRecord

CTX = 1024  # the machine check's decode shapes: batch 1 and 8, 1024 tokens of context per sequence


@dataclass(frozen=True)
class Calibration:
    prefill_scale: float = 1.0
    decode_fixed_scale: float = 1.0
    decode_row_scale: float = 1.0
    serving_ttft_s: float = 0.0
    serving_ttft_token_s: float = 0.0  # the serving path's TTFT per prompt token (a serving probe's cached sends)
    relay_token_s: float = 0.0
    serving_step_s: float = 0.0  # the serving layer's time per decode step, whatever its batch (a batch probe)
    off_step_cpu_token_s: float = 0.0  # a replica's CPU per token outside its steps (pdserve.sim.host)
    serving_cpu_token_s: float = 0.0  # the host's CPU per token outside the replicas (proxy, router, client)
    background_cores: float = 0.0  # what the host burns with no load (Ray, Serve, idle loops), in cores
    wake_wait_s: float = 0.0  # ClusterSpec.wake_wait_s: a woken step thread's wait for a busy host's cores
    source: str = "none"  # where the scales came from
    prefill_cached_scale: float | None = None  # the prefill's n x cached term; None: prefill_scale

    def __post_init__(self) -> None:
        for name in ("prefill_scale", "decode_fixed_scale", "decode_row_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.prefill_cached_scale is not None and not self.prefill_cached_scale > 0:
            raise ValueError(f"prefill_cached_scale must be > 0, got {self.prefill_cached_scale}")
        for name in ("serving_ttft_s", "serving_ttft_token_s", "relay_token_s", "serving_step_s",
                     "off_step_cpu_token_s", "serving_cpu_token_s", "background_cores", "wake_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def spec(self, spec: ClusterSpec) -> ClusterSpec:
        """The cluster with the off-step, serving and background CPU on its shared cores, and the wake-up wait."""
        return dataclasses.replace(spec, off_step_cpu_token_s=self.off_step_cpu_token_s,
                                   serving_cpu_token_s=self.serving_cpu_token_s,
                                   background_cores=self.background_cores, wake_wait_s=self.wake_wait_s)

    def model(self, m: LatencyModel) -> LatencyModel:
        p, d, s = m.prefill, m.decode, self.prefill_scale
        cached = s if self.prefill_cached_scale is None else self.prefill_cached_scale
        return dataclasses.replace(
            m, prefill=PrefillModel(p.a * s, p.b * s, p.c * s, p.d * cached),
            decode=DecodeModel(d.a * self.decode_fixed_scale + self.serving_step_s, d.b * self.decode_row_scale + self.relay_token_s,
                               d.c * self.decode_row_scale))

    def profile(self, profile: LatencyProfile) -> LatencyProfile:
        """The profile as the live run's engines step (scaled, relay in the decode rows)."""
        return dataclasses.replace(profile, models={r: self.model(m) for r, m in profile.models.items()})

    def records(self, records: Sequence[RequestRecord]) -> list[RequestRecord]:
        """Records as the client saw them: the serving layer's delay before the first token."""
        def delay(r: RequestRecord) -> float:
            return self.serving_ttft_s + self.serving_ttft_token_s * r.request.prompt_tokens

        return [dataclasses.replace(r, first_token_s=None if r.first_token_s is None else r.first_token_s + delay(r),
                                    finish_s=None if r.finish_s is None else r.finish_s + delay(r)) for r in records]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def scales_from_machine(check: Mapping[str, Any], profile: LatencyProfile) -> tuple[float, float, float]:
    """(prefill, decode fixed, decode row) scales from a machine check's measured/profiled shapes
    (`MachineCheck.to_dict()`): prefill_1024's ratio; the decode pair solves
      f·a + r·(b + c·CTX) = m1,  f·a + r·8·(b + c·CTX) = m8
    (a uniform decode scale, the batch-8 ratio, when that gives a non-positive f or r)."""
    shapes = {s["shape"]: s["measured_ms"] / 1e3 for s in check["shapes"]}
    prefill = shapes["prefill_1024"] / profile.for_role("prefill").prefill_time_s(1024)
    d = profile.for_role("decode").decode
    row = d.b + d.c * CTX
    m1, m8 = shapes["decode_b1_ctx1024"], shapes["decode_b8_ctx1024"]
    r = (m8 - m1) / (7 * row) if row > 0 else 0.0
    f = (m1 - r * row) / d.a if d.a > 0 else 0.0
    if f <= 0 or r <= 0:
        f = r = m8 / d.step_s(8, 8 * CTX)
    return prefill, f, r


def cached_prefill_scale(check: Mapping[str, Any], profile: LatencyProfile, prefill_scale: float) -> float | None:
    """The scale of the profile's n x cached prefill term, from a check's `prefill_512_cached1024` shape: what
    that shape measured beyond the uncached part at `prefill_scale`, over the profile's term. None without
    the shape (reports before it), or when the profile has no such term or the excess is not positive."""
    shapes = {s["shape"]: s["measured_ms"] / 1e3 for s in check["shapes"]}
    if "prefill_512_cached1024" not in shapes:
        return None
    p = profile.for_role("prefill").prefill
    term = p.d * 512 * 1024
    excess = shapes["prefill_512_cached1024"] - prefill_scale * p.time_s(512)
    return excess / term if term > 0 and excess > 0 else None


def off_step_cpu(measured_s: float, modelled_s: float, tokens: int) -> float:
    """CPU seconds per generated token that the replicas spent beyond the model's steps, from one live point's
    measured replica CPU; never negative."""
    return max(0.0, measured_s - modelled_s) / tokens if tokens > 0 else 0.0


@dataclass(frozen=True)
class CPUAccount:
    """One live point's CPU as a report measured it (pdserve.proc_cpu): the replicas' (prefill and decode),
    the whole host's when recorded, and the target's quiet window before its sweep when recorded."""

    duration_s: float
    replicas_s: float
    host_s: float | None = None
    quiet_replica_cores: float = 0.0
    quiet_host_cores: float | None = None

    @classmethod
    def of(cls, point: Mapping[str, Any], quiet: Mapping[str, Any] | None) -> CPUAccount | None:
        cpu = point.get("replica_cpu_s") or {}
        if not any(role in cpu for role in ("prefill", "decode")):
            return None
        host = (point.get("host_cpu_s") or {}).get("host")
        q_replicas, q_host = 0.0, None
        if quiet and quiet.get("seconds"):
            q_replicas = sum(v for r, v in (quiet.get("replicas") or {}).items() if r in ("prefill", "decode"))
            q_replicas /= quiet["seconds"]
            q_host = quiet["host"] / quiet["seconds"] if "host" in quiet else None
        return cls(float(point["summary"]["duration_s"]), sum(v for r, v in cpu.items() if r in ("prefill", "decode")),
                   host, q_replicas, q_host)

    def costs(self, steps_s: float, tokens: int) -> tuple[float, float, float]:
        """(off_step_cpu_token_s, serving_cpu_token_s, background_cores) given the model's step CPU for the
        point: the replicas' CPU beyond their steps and their quiet rate, per token; the host's beyond the
        replicas' and its quiet rate, per token; the quiet host's cores. Without a host figure the last two
        are 0; without a quiet window the host's excess is all per token."""
        d = self.duration_s
        off_step = off_step_cpu(self.replicas_s - self.quiet_replica_cores * d, steps_s, tokens)
        if self.host_s is None:
            return off_step, 0.0, 0.0
        quiet_rest = 0.0 if self.quiet_host_cores is None else (self.quiet_host_cores - self.quiet_replica_cores) * d
        serving = off_step_cpu(self.host_s - quiet_rest, self.replicas_s, tokens)
        return off_step, serving, self.quiet_host_cores or 0.0


def serving_costs(live_ttft_s: float, live_tpot_s: float, sim_ttft_s: float, sim_tpot_s: float) -> tuple[float, float]:
    """(serving_ttft_s, relay_token_s): what the idle probe measured beyond the scaled simulator's idle
    request; never negative (a live figure below the simulated one leaves that cost at 0)."""
    return max(0.0, live_ttft_s - sim_ttft_s), max(0.0, live_tpot_s - sim_tpot_s)


def serving_step(live_tpot_s: float, tpot_at: Callable[[float], float], tol_s: float = 1e-5) -> float:
    """The serving layer's time per decode step: the cost s >= 0 at which the simulator's TPOT for a batch
    probe's requests, `tpot_at(s)`, meets the probe's live TPOT (0 when the simulator is already as slow).
    On shared cores every step is stretched by the host's sharing, s with it, so the simulated TPOT grows by
    s or more: the plain gap `live - tpot_at(0)` bounds s from above, and taken as s it over-shoots by the
    sharing factor (three one-thread replicas on two cores: by half or more). Solved by bisection to `tol_s`."""
    gap = live_tpot_s - tpot_at(0.0)
    if gap <= 0:
        return 0.0
    lo, hi = 0.0, gap
    while tpot_at(hi) < live_tpot_s and hi < 1.0:  # a step's s never lands below s (guarded all the same)
        lo, hi = hi, 2 * hi
    while hi - lo > tol_s:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tpot_at(mid) < live_tpot_s else (lo, mid)
    return (lo + hi) / 2


def rel_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured; a measured 0 gives 0 when predicted is 0 too, else 1."""
    if measured == 0:
        return 0.0 if predicted == 0 else 1.0
    return abs(predicted - measured) / abs(measured)
