"""The calibration arithmetic (pdserve.sim.calibrate) and the shared-cores slow-down, on round numbers."""

from __future__ import annotations

import pytest
from pdserve.sim.calibrate import (
    cached_prefill_scale,
    CTX,
    Calibration,
    CPUAccount,
    off_step_cpu,
    rel_error,
    scales_from_machine,
    serving_costs,
    serving_step,
)
from pdserve.sim.scenario import batch_latency, cached_ttft
from pdserve.sim.cluster import Simulation
from pdserve.placement.policy import PlacementConfig
from pdserve.sim.config import ClusterSpec, EngineSpec, RouterSpec, SimRequest
from pdserve.sim.host import OffStepLoad, SharedCores


def check(profile, prefill_ratio: float, fixed: float, row: float) -> dict:
    m = profile.for_role("decode")
    d = m.decode
    b1 = fixed * d.a + row * (d.b + d.c * CTX)
    b8 = fixed * d.a + row * 8 * (d.b + d.c * CTX)
    return {"shapes": [
        {"shape": "prefill_1024", "measured_ms": prefill_ratio * m.prefill_time_s(1024) * 1e3},
        {"shape": "decode_b1_ctx1024", "measured_ms": b1 * 1e3},
        {"shape": "decode_b8_ctx1024", "measured_ms": b8 * 1e3}]}


def test_machine_check_scales_are_solved_back(profile):
    prefill, fixed, row = scales_from_machine(check(profile, 1.5, 1.2, 2.0), profile)
    assert prefill == pytest.approx(1.5) and fixed == pytest.approx(1.2) and row == pytest.approx(2.0)


def test_a_check_that_solves_negative_falls_back_to_a_uniform_decode_scale(profile):
    c = check(profile, 1.0, 1.0, 1.0)
    c["shapes"][2]["measured_ms"] = c["shapes"][1]["measured_ms"]  # batch 8 as fast as batch 1: no row cost
    _, fixed, row = scales_from_machine(c, profile)
    d = profile.for_role("decode").decode
    assert fixed == row == pytest.approx(c["shapes"][2]["measured_ms"] / 1e3 / d.step_s(8, 8 * CTX))


def test_serving_costs_are_the_idle_gap_and_never_negative():
    assert serving_costs(0.444, 0.0095, 0.142, 0.0049) == pytest.approx((0.302, 0.0046))
    assert serving_costs(0.1, 0.004, 0.142, 0.0049) == (0.0, 0.0)


def test_calibrated_profile_scales_and_adds_the_relay_per_row(profile):
    cal = Calibration(2.0, 1.5, 3.0, serving_ttft_s=0.1, relay_token_s=0.001)
    base, m = profile.for_role("decode"), cal.profile(profile).for_role("decode")
    assert m.prefill_time_s(1000, 64) == pytest.approx(2.0 * base.prefill_time_s(1000, 64))
    d = base.decode
    assert m.decode_step_s(4, 4000) == pytest.approx(1.5 * d.a + 3.0 * (4 * d.b + 4000 * d.c) + 4 * 0.001)
    assert m.kv_bytes_per_token == base.kv_bytes_per_token and m.transfers == base.transfers


def test_a_lone_request_gets_the_idle_figures_back(profile):
    """Calibrated from one idle request, the simulator returns that request's live TTFT and TPOT."""
    spec = ClusterSpec(mode="colocated", num_decode=1)
    request = [SimRequest(0, 0.0, 800, 64)]
    scaled = Calibration(1.4, 1.3, 1.6)
    (alone,) = Simulation(spec, scaled.profile(profile), request).run()
    live_ttft, live_tpot = alone.ttft_s + 0.3, alone.tpot_s + 0.004
    ttft, relay = serving_costs(live_ttft, live_tpot, alone.ttft_s, alone.tpot_s)
    cal = Calibration(1.4, 1.3, 1.6, serving_ttft_s=ttft, relay_token_s=relay)
    (record,) = cal.records(Simulation(spec, cal.profile(profile), request).run())
    assert record.ttft_s == pytest.approx(live_ttft) and record.tpot_s == pytest.approx(live_tpot)


def test_rel_error():
    assert rel_error(120.0, 100.0) == pytest.approx(0.2)
    assert rel_error(0.0, 0.0) == 0.0 and rel_error(0.5, 0.0) == 1.0


@pytest.mark.parametrize(("num_cores", "slowdown"), [(None, 1.0), (4.0, 1.0), (2.0, 1.5), (1.0, 3.0)])
def test_shared_cores_slow_concurrent_steps(profile, num_cores, slowdown):
    """Three one-thread replicas each start a lone prefill at t=0: on `num_cores` cores every step takes
    max(1, 3 / cores) times its profiled time (the first one alone: it starts before the others are busy)."""
    spec = ClusterSpec(mode="colocated", num_decode=3, decode=EngineSpec(), num_cores=num_cores)
    records = Simulation(spec, profile, [SimRequest(i, 0.0, 500, 1) for i in range(3)]).run()
    alone = profile.for_role("decode").prefill_time_s(500)
    assert max(r.ttft_s for r in records) == pytest.approx(alone * slowdown)


@pytest.mark.parametrize(("num_cores", "slowdown"), [(None, 1.0), (4.0, 1.0), (2.0, 1.5), (1.0, 3.0)])
def test_continuously_shared_cores_slow_concurrent_steps_alike(profile, num_cores, slowdown):
    """The same three prefills starting together, shared continuously: each runs at cores / 3 throughout."""
    spec = ClusterSpec(mode="colocated", num_decode=3, num_cores=num_cores, core_sharing="continuous")
    records = Simulation(spec, profile, [SimRequest(i, 0.0, 500, 1) for i in range(3)]).run()
    alone = profile.for_role("decode").prefill_time_s(500)
    assert [r.ttft_s for r in records] == pytest.approx([alone * slowdown] * 3)


def test_a_step_slows_when_another_starts_beside_it_and_speeds_up_when_it_ends():
    # one core; a 1 s step from t=0, another from t=0.5: the first does 0.5 s alone, then both run at half
    # speed until it ends at 1.5 s; the second, 0.5 s done by then, ends alone at 2.0 s
    cores = SharedCores(1.0)
    cores.start("a", 1.0, 1.0, 0.0)
    assert cores.reshare(0.0, 0.0) == {"a": pytest.approx(1.0)}
    cores.start("b", 1.0, 1.0, 0.5)
    assert cores.reshare(0.5, 0.0) == {"a": pytest.approx(1.5), "b": pytest.approx(2.5)}
    cores.finish("a", 1.5)
    assert cores.reshare(1.5, 0.0) == {"b": pytest.approx(2.0)}
    # other work on the cores counts in the demand: one step beside a core's worth of off-step work
    assert cores.reshare(1.5, 1.0) == {"b": pytest.approx(2.5)}


def test_a_woken_step_waits_for_a_core_by_its_share_of_the_wait_before_it_runs():
    # one core; b starts at 0.5 beside a, with a 0.4 s wake wait at rate 0.5: it runs from 0.7, while a, the
    # waiting thread counted in the demand, still runs at half speed and ends at 1.5; b, 0.4 s done by then,
    # ends alone at 2.1
    cores = SharedCores(1.0)
    cores.start("a", 1.0, 1.0, 0.0, wake_s=0.4)
    assert cores.reshare(0.0, 0.0) == {"a": pytest.approx(1.0)}  # alone: no wait
    cores.start("b", 1.0, 1.0, 0.5, wake_s=0.4)
    assert cores.reshare(0.5, 0.0) == {"a": pytest.approx(1.5), "b": pytest.approx(2.7)}
    cores.finish("a", 1.5)
    assert cores.reshare(1.5, 0.0) == {"b": pytest.approx(2.1)}


def test_calibration_is_validated():
    with pytest.raises(ValueError, match="prefill_scale"):
        Calibration(prefill_scale=0)
    with pytest.raises(ValueError, match="num_cores"):
        ClusterSpec(num_cores=0)
    with pytest.raises(ValueError, match="core_sharing"):
        ClusterSpec(num_cores=2.0, core_sharing="fair")  # type: ignore[arg-type]


def test_off_step_load_is_the_last_window_of_cpu_in_cores():
    load = OffStepLoad(0.01, window_s=1.0)
    assert load.add(0.0, 50) == pytest.approx(0.5)
    load.add(0.5, 50)
    assert load.cores(0.9) == pytest.approx(1.0)
    assert load.cores(1.2) == pytest.approx(0.5)  # the first 50 tokens left the window
    assert load.cores(2.0) == 0.0
    with pytest.raises(ValueError, match="cpu_per_token_s"):
        OffStepLoad(-1.0)


def test_off_step_cpu_is_the_measured_excess_per_token_and_never_negative():
    assert off_step_cpu(60.0, 48.0, 4000) == pytest.approx(0.003)
    assert off_step_cpu(40.0, 48.0, 4000) == 0.0 and off_step_cpu(60.0, 48.0, 0) == 0.0


def test_replica_cpu_is_its_steps_plus_its_off_step_work_per_token(profile):
    """One request alone: the engine's CPU is its prefill plus each decode step (profiled time, one thread),
    plus the off-step cost of each of its tokens, whether or not the host's cores are shared."""
    m = profile.for_role("decode")
    request = SimRequest(0, 0.0, 200, 5)
    for cores in (None, 2.0):
        spec = ClusterSpec(mode="colocated", decode=EngineSpec(), num_cores=cores, off_step_cpu_token_s=0.002)
        sim = Simulation(spec, profile, [request])
        sim.run()
        steps = m.prefill_time_s(200) + sum(m.decode.step_s(1, 200 + k) for k in range(1, 5))
        assert sim.cpu_seconds()["decode"] == pytest.approx(steps + 5 * 0.002, rel=1e-6)
        counted = sim.step_seconds()["decode"]  # the live engines' step counters' twin: 1 prefill + 4 decodes
        assert counted["num_steps"] == 5 and counted["step_cpu_s"] == pytest.approx(steps, rel=1e-6)
        assert counted["step_s"] == pytest.approx(steps, rel=1e-6)  # alone, on cores enough: wall = CPU
        assert counted["num_prefill_steps"] == 1 and counted["prefill_step_cpu_s"] == pytest.approx(m.prefill_time_s(200))


def test_steps_sharing_too_few_cores_take_more_wall_than_cpu(profile):
    """Two one-thread replicas decoding at once on one core: each step's wall time is about twice its CPU."""
    spec = ClusterSpec(mode="colocated", num_decode=2, num_cores=1.0,
                       router=RouterSpec(placement=PlacementConfig(policy="round_robin")))  # one request each
    sim = Simulation(spec, profile, [SimRequest(0, 0.0, 16, 200), SimRequest(1, 0.0, 16, 200)])
    sim.run()
    counted = sim.step_seconds()["decode"]
    assert counted["num_steps"] == 400 and 1.8 < counted["step_s"] / counted["step_cpu_s"] <= 2.0
    assert sim.step_seconds()["prefill"]["num_steps"] == 0


def test_a_woken_step_waits_for_a_core_only_where_the_cores_are_taken(profile):
    """wake_wait_s: each step starts wake_wait_s x (1 - 1/slow-down) late; two replicas on one core slow each
    other about 2x, so about half of it; alone on its own core a step never waits."""
    requests = [SimRequest(0, 0.0, 16, 200), SimRequest(1, 0.0, 16, 200)]

    def wall(cores, wake):
        spec = ClusterSpec(mode="colocated", num_decode=2, num_cores=cores, wake_wait_s=wake,
                           router=RouterSpec(placement=PlacementConfig(policy="round_robin")))
        sim = Simulation(spec, profile, requests)
        sim.run()
        return sim.step_seconds()["decode"]["step_s"]

    assert wall(2.0, 0.004) == pytest.approx(wall(2.0, 0.0))  # a core each: never all taken
    assert wall(None, 0.004) == pytest.approx(wall(None, 0.0))
    extra = (wall(1.0, 0.004) - wall(1.0, 0.0)) / 400  # per step
    assert 0.0015 < extra < 0.0025
    with pytest.raises(ValueError, match="wake_wait_s"):
        ClusterSpec(wake_wait_s=-1.0)


def test_off_step_work_takes_cores_from_the_steps(profile):
    """One one-thread replica on one core: a request's decode steps slow by the off-step load the
    tokens of the last second put on that core; with no off-step cost (or cores of its own) they do not."""
    requests = [SimRequest(0, 0.0, 100, 400)]

    def tpot(cores, cost):
        spec = ClusterSpec(mode="colocated", decode=EngineSpec(), num_cores=cores, off_step_cpu_token_s=cost)
        return Simulation(spec, profile, requests).run()[0].tpot_s

    assert tpot(1.0, 0.0) == pytest.approx(tpot(None, 0.005))
    assert tpot(1.0, 0.005) > 1.4 * tpot(1.0, 0.0)
    assert ClusterSpec(off_step_cpu_token_s=0.0) and pytest.raises(ValueError, ClusterSpec, off_step_cpu_token_s=-1)


def test_cpu_account_splits_the_hosts_cpu_into_replicas_serving_and_background():
    """A 100 s point, 4,000 tokens: the replicas burned 70 s (0.1 cores of it their quiet rate, 40 s their
    steps), the host 120 s (0.3 cores of it its quiet rate). Off-step: (70 - 10 - 40) / 4000; serving:
    (120 - 70 - (0.3 - 0.1) x 100) / 4000; background: the quiet host's 0.3 cores."""
    point = {"summary": {"duration_s": 100.0}, "replica_cpu_s": {"decode": 50.0, "prefill": 20.0, "router": 5.0},
             "host_cpu_s": {"host": 120.0, "client": 4.0}}
    quiet = {"seconds": 10.0, "host": 3.0, "client": 0.0, "replicas": {"decode": 0.6, "prefill": 0.4, "router": 0.5}}
    account = CPUAccount.of(point, quiet)
    assert account.costs(40.0, 4000) == pytest.approx((0.005, 0.0075, 0.3))
    no_quiet = CPUAccount.of(point, None)  # the host's excess is all per token
    assert no_quiet.costs(40.0, 4000) == pytest.approx((0.0075, 0.0125, 0.0))
    replicas_only = CPUAccount.of({**point, "host_cpu_s": None}, None)  # as the committed reports
    assert replicas_only.costs(40.0, 4000) == pytest.approx((0.0075, 0.0, 0.0))
    assert CPUAccount.of({**point, "replica_cpu_s": None}, quiet) is None


def test_background_cores_slow_every_step_on_a_shared_host(profile):
    """Half a core always busy on a one-core host: a lone request's steps take 1.5 times as long."""
    def ttft(background):
        spec = ClusterSpec(mode="colocated", decode=EngineSpec(), num_cores=1.0, background_cores=background)
        return Simulation(spec, profile, [SimRequest(0, 0.0, 500, 1)]).run()[0].ttft_s

    assert ttft(0.5) == pytest.approx(1.5 * ttft(0.0))
    with pytest.raises(ValueError, match="background_cores"):
        ClusterSpec(background_cores=-0.1)


def test_the_cached_prefix_term_scales_on_its_own_shape(profile):
    """A check whose cached-prefix shape took longer than its uncached part predicts scales the profile's
    n x cached term alone; a report without the shape leaves it at the prefill scale."""
    p = profile.for_role("prefill").prefill
    uncached = 1.5 * p.time_s(512)
    check = {"shapes": [{"shape": "prefill_512_cached1024", "measured_ms": (uncached + 3.0 * p.d * 512 * 1024) * 1e3}]}
    scale = cached_prefill_scale(check, profile, 1.5)
    assert scale == pytest.approx(3.0) or p.d == 0
    cal = Calibration(1.5, 1.0, 1.0, prefill_cached_scale=scale)
    m = cal.profile(profile).for_role("prefill")
    assert m.prefill_time_s(512, 1024) * 1e3 == pytest.approx(check["shapes"][0]["measured_ms"])
    assert m.prefill_time_s(512) == pytest.approx(uncached)
    assert cached_prefill_scale({"shapes": []}, profile, 1.5) is None
    assert Calibration(1.5, 1.0, 1.0).profile(profile).for_role("prefill").prefill.d == pytest.approx(1.5 * p.d)
    with pytest.raises(ValueError, match="prefill_cached_scale"):
        Calibration(1.0, 1.0, 1.0, prefill_cached_scale=0.0)


def test_serving_step_is_the_batch_probes_gap_where_it_adds_plainly_and_never_negative():
    assert serving_step(0.0057, lambda s: 0.0045 + s) == pytest.approx(0.0012, abs=1e-5)
    assert serving_step(0.004, lambda s: 0.0045 + s) == 0.0


def test_serving_step_is_solved_where_sharing_stretches_it():
    # every step 1.5x on shared cores, the cost with it: the plain gap (1.5 ms) would give 2.25 ms too much
    assert serving_step(0.006, lambda s: 1.5 * (0.003 + s)) == pytest.approx(0.001, abs=1e-5)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_the_serving_step_adds_once_to_every_decode_step_whatever_the_batch(profile, batch):
    cal = Calibration(1.0, 1.0, 1.0, serving_step_s=0.0011)
    base, m = profile.for_role("decode"), cal.profile(profile).for_role("decode")
    assert m.decode_step_s(batch, 512 * batch) == pytest.approx(base.decode_step_s(batch, 512 * batch) + 0.0011)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_batch_probe_gets_its_live_tpot_back(profile, mode):
    """Calibrated from k requests decoding together, the simulator returns their live TPOT."""
    spec = ClusterSpec(mode=mode, num_decode=1)
    scaled = Calibration(1.4, 1.3, 1.6)
    sim = batch_latency(spec, scaled.profile(profile), 8, 64, 128)
    live = sim + 0.0012

    def tpot_at(step_s: float) -> float:
        return batch_latency(spec, Calibration(1.4, 1.3, 1.6, serving_step_s=step_s).profile(profile), 8, 64, 128)

    cal = Calibration(1.4, 1.3, 1.6, serving_step_s=serving_step(live, tpot_at))
    assert batch_latency(spec, cal.profile(profile), 8, 64, 128) == pytest.approx(live, rel=0.02)


def test_a_batch_probe_on_oversubscribed_cores_gets_its_live_tpot_back(profile):
    """Three one-thread replicas on two cores: the solved cost, stretched by the sharing, returns the probe's
    TPOT, where the plain gap over-shoots it."""
    spec = ClusterSpec(mode="colocated", num_decode=3, num_cores=2.0, serving_cpu_token_s=0.0005)
    sim = batch_latency(spec, profile, 8, 64, 128)
    live = sim + 0.002

    def tpot_at(step_s: float) -> float:
        return batch_latency(spec, Calibration(serving_step_s=step_s).profile(profile), 8, 64, 128)

    assert tpot_at(serving_step(live, tpot_at)) == pytest.approx(live, rel=0.01)
    assert tpot_at(live - sim) > 1.1 * live  # the plain gap, as calibrated before


def test_a_batch_probes_requests_decode_together(profile):
    """k requests arriving together: every TPOT is at least the batch-k step, and above one request alone."""
    spec = ClusterSpec(mode="disaggregated", num_decode=1)
    d = profile.for_role("decode")
    alone, eight = (batch_latency(spec, profile, k, 64, 128) for k in (1, 8))
    assert eight > alone >= d.decode_step_s(1, 64)
    assert eight >= d.decode_step_s(8, 8 * 64)


def test_the_serving_path_delays_each_request_by_its_fixed_part_and_its_prompt(profile):
    cal = Calibration(serving_ttft_s=0.008, serving_ttft_token_s=5e-6)
    short, long = (SimRequest(i, 0.0, n, 4) for i, n in enumerate((16, 1000)))
    records = cal.records(Simulation(ClusterSpec(mode="colocated", num_decode=2), profile, [short, long]).run())
    bare = Simulation(ClusterSpec(mode="colocated", num_decode=2), profile, [short, long]).run()
    for got, was, n in zip(records, bare, (16, 1000)):
        assert got.ttft_s == pytest.approx(was.ttft_s + 0.008 + 5e-6 * n)
        assert got.tpot_s == pytest.approx(was.tpot_s)  # a delay before the first token, not a slower stream
    with pytest.raises(ValueError, match="serving_ttft_token_s"):
        Calibration(serving_ttft_token_s=-1e-6)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_a_prompt_sent_again_finds_its_blocks_and_prefills_only_the_rest(profile, mode):
    """1024 tokens, 1008 of them cached (63 blocks of 16, as the live engine hashes all but the last token's
    block): the second send's TTFT is the prefill of 16 new tokens behind 1008 cached, on any replica count."""
    spec = ClusterSpec(mode=mode, num_prefill=2, num_decode=3, transport="tcp")  # no transfer model: free
    m = profile.for_role("decode")  # one model for both roles here
    assert cached_ttft(spec, profile, 1024, 1008) == pytest.approx(m.prefill_time_s(16, 1008), rel=1e-6)
    assert cached_ttft(spec, profile, 1024, 0) == pytest.approx(m.prefill_time_s(1024), rel=1e-6)
