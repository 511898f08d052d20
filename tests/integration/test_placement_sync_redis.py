"""Placement sync over a real Redis: what one router places shows in the other routers' views before the
next stats poll, so routers sharing a stale view stop herding even with no random choice; a Redis that
dies costs only the sharing, never a placement."""

from __future__ import annotations

import asyncio
import time
from collections import Counter


from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel
from pdserve.placement.pending import PendingPlacements
from pdserve.placement.policy import PlacementConfig, PlacementRequest, ReplicaSnapshot, create_policy
from pdserve.placement.sync import RedisPlacementSync

BS = 16
PROFILE = LatencyProfile({"default": LatencyModel(
    PrefillModel(a=0.01, b=1e-4, c=0.0), DecodeModel(a=0.02, b=1e-3, c=1e-6), kv_bytes_per_token=1000)})


def _snap(replica_id: str) -> ReplicaSnapshot:
    return ReplicaSnapshot(replica_id, "decode", age_s=0.05, num_running=0, num_waiting=0, queued_prefill_tokens=0,
                           num_free_blocks=1000, num_total_blocks=1000, block_size=BS, num_context_tokens=0)


class Router:
    """A router's placement state as placer.py keeps it: a policy, pending placements, and the sync."""

    def __init__(self, url: str, channel: str, seed: int, tolerance: float) -> None:
        config = PlacementConfig(policy="slo_aware", calibrate_step_times=False, choice_tolerance=tolerance,
                                 seed=seed, admission="queue")
        self.policy = create_policy(config, PROFILE, False)
        self.pending = PendingPlacements(grace_s=0.0)
        self.sync = RedisPlacementSync(url, channel, flush_s=0.001)
        self.sync.start(lambda entries: [self.pending.record(r, p, b, t) for r, p, b, t in entries])

    def place(self, view: list[ReplicaSnapshot]) -> str:
        request = PlacementRequest(100, 32, 1.0, 0.1)
        placement = self.policy.place(request, [], [self.pending.apply(s) for s in view])
        self.sync.publish(self.pending.record_placement(placement, request, BS))
        return placement.decode_replica


async def _heard(routers: list[Router], expected: list[int], timeout: float = 5.0) -> None:
    """Until router j has received expected[j] messages from the others."""
    deadline = time.monotonic() + timeout
    while any(r.sync.num_received < n for r, n in zip(routers, expected, strict=True)):
        assert time.monotonic() < deadline, ([r.sync.num_received for r in routers], expected)
        await asyncio.sleep(0.002)


async def _herd(url: str, channel: str, *, synced: bool, num_routers: int = 4, rounds: int = 4) -> Counter:
    """Routers sharing one stale view of 8 idle replicas, placing in turn, always on the best prediction
    (choice_tolerance 0); with `synced`, each placement is heard by the others before the next one."""
    routers = [Router(url, channel if synced else f"{channel}:{k}", seed=k, tolerance=0.0)
               for k in range(num_routers)]
    try:
        await asyncio.sleep(0.3)  # subscriptions in place
        view, placed, expected = [_snap(f"d{i}") for i in range(8)], Counter(), [0] * num_routers
        for _ in range(rounds):
            for k, router in enumerate(routers):
                placed[router.place(view)] += 1
                if synced:
                    expected = [n + (j != k) for j, n in enumerate(expected)]
                    await _heard(routers, expected)
        return placed
    finally:
        await asyncio.gather(*(r.sync.close() for r in routers))


def test_routers_that_share_placements_do_not_herd(redis_server):
    async def run() -> tuple[Counter, Counter]:
        alone = await _herd(redis_server.url, "test:placements:alone", synced=False)
        shared = await _herd(redis_server.url, "test:placements:shared", synced=True)
        return alone, shared

    alone, shared = asyncio.run(run())
    assert sorted(alone.values()) == [4, 4, 4, 4]  # each round, every router picks the same best replica
    assert len(shared) == 8 and max(shared.values()) == 2  # each placement seen: spread over all 8


def test_a_dead_redis_costs_only_the_sharing(redis_server_factory):
    server = redis_server_factory(password="sync-pw")

    async def run() -> None:
        a, b = (Router(server.url, "test:placements:fault", seed=k, tolerance=0.0) for k in range(2))
        try:
            await asyncio.sleep(0.3)
            view = [_snap(f"d{i}") for i in range(8)]
            a.place(view)
            await _heard([a, b], [0, 1])
            server.proc.kill()  # SIGKILL: no goodbye to the subscriber
            server.proc.wait()
            server.proc = None
            for _ in range(5):  # placement goes on, on each router's own view
                a.place(view)
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            assert a.sync.num_dropped >= 1 and b.sync.num_received == 1
            server.start()  # same port and password: the subscriber reconnects with backoff
            deadline = time.monotonic() + 15
            while b.sync.num_received < 2:
                assert time.monotonic() < deadline, "sync did not resume after Redis came back"
                a.place(view)
                await asyncio.sleep(0.1)
        finally:
            await asyncio.gather(a.sync.close(), b.sync.close())

    asyncio.run(run())
