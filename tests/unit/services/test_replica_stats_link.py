"""The router's stats poller over real worker links on loopback: the first poll asks the replica actor,
later ones are STATS calls on the link its reply named; a link that fails (replica restarted with a new
address and token, or another replica answering) sends the poll back to the actor, which refreshes the
link, and a dead actor drops the replica. The actor is a stand-in with record_routing_stats only."""

from __future__ import annotations

import asyncio
from collections import Counter

from ray.exceptions import RayActorError

from pdserve.placement.prefix_index import PrefixIndex
from pdserve.services.router.replica_stats import ReplicaStatsPoller
from pdserve.worklink import LinkClient, LinkServer

KEY = ("decode", "r1")


class Replica:
    """A replica's two faces: its link server (STATS) and its actor's record_routing_stats."""

    def __init__(self, token: str, name: str = "r1") -> None:
        self.token, self.name = token, name
        self.server = LinkServer(token, stats=self.stats)
        self.address = ""
        self.actor_calls = 0
        self.dead = False
        self.record_routing_stats = self  # actor.record_routing_stats.remote()

    async def start(self) -> Replica:
        self.address = await self.server.start("127.0.0.1")
        return self

    async def stats(self, want_events: bool, cursor) -> dict:
        reply = {"replica": self.name, "num_running": 1}
        if want_events:
            reply["kv_events"] = {"epoch": "e", "seq": 1, "reset": True, "events": [], "hashes": [11, 12],
                                  "replica": self.name, "layout_hash": 5}
        return reply

    def remote(self):
        self.actor_calls += 1
        future = asyncio.get_running_loop().create_future()
        if self.dead:
            future.set_exception(RayActorError())
        else:
            future.set_result({"replica": "r1", "num_running": 0, "link": self.address, "link_token": self.token})
        return future


def _poller(paths: Counter, index: PrefixIndex | None = None) -> ReplicaStatsPoller:
    return ReplicaStatsPoller("app", ("decode",), staleness_s=2.0, links=LinkClient(), index=index,
                              kv_sources={"decode": object()} if index is not None else None,
                              on_poll=lambda role, path: paths.update([path]))


def test_polls_move_to_the_link_and_back_to_the_actor_when_it_fails():
    async def main():
        paths: Counter = Counter()
        index = PrefixIndex(max_age_s=60.0, expect_s=0.0)
        poller = _poller(paths, index)
        first = await Replica("t1").start()
        poller._actors = {KEY: first}
        try:
            await poller._poll()
            assert paths == {"serve": 1} and poller.latest(*KEY).stats["link"] == first.address
            await poller._poll()
            await poller._poll()
            assert paths == {"serve": 1, "link": 2} and first.actor_calls == 1
            assert poller.latest(*KEY).stats["num_running"] == 1  # the link's answer
            held = index.held("r1")  # KV events came in the STATS reply
            assert 11 in held and 12 in held and 13 not in held
            # the replica restarts elsewhere with a new token: the old link is refused, the actor names the new one
            await first.server.stop()
            second = await Replica("t2").start()
            poller._actors = {KEY: second}
            await poller._poll()
            assert paths["serve"] == 2 and poller.latest(*KEY).stats["link_token"] == "t2"
            await poller._poll()
            assert paths["link"] == 3 and second.actor_calls == 1
            # a link that now answers for another replica is not trusted
            impostor = await Replica("t2", name="r9").start()
            poller._store(KEY, {**poller.latest(*KEY).stats, "link": impostor.address})
            await poller._poll()
            assert paths["serve"] == 3 and second.actor_calls == 2
            assert poller.latest(*KEY).stats["link"] == second.address
            # a dead actor: the replica drops out at once
            await impostor.server.stop()
            await second.server.stop()
            second.dead = True
            await poller._poll()
            assert poller.latest(*KEY) is None and poller.snapshots("decode") == []
        finally:
            await poller.links.close()
            await first.server.stop()
    asyncio.run(main())


def test_without_links_every_poll_asks_the_actor():
    async def main():
        paths: Counter = Counter()
        poller = ReplicaStatsPoller("app", ("decode",), on_poll=lambda role, path: paths.update([path]))
        replica = await Replica("t1").start()
        poller._actors = {KEY: replica}
        try:
            for _ in range(3):
                await poller._poll()
            assert paths == {"serve": 3} and replica.actor_calls == 3
        finally:
            await replica.server.stop()
    asyncio.run(main())


def test_a_link_that_times_out_leaves_the_snapshot_to_age():
    async def main():
        paths: Counter = Counter()
        poller = ReplicaStatsPoller("app", ("decode",), staleness_s=0.2, links=LinkClient(),
                                    on_poll=lambda role, path: paths.update([path]))
        replica = await Replica("t1").start()
        release = asyncio.Event()

        async def slow(want_events, cursor):
            await release.wait()
            return {"replica": "r1"}
        poller._actors = {KEY: replica}
        try:
            await poller._poll()
            replica.server.stats = slow
            received = poller.latest(*KEY).received_at
            await poller._poll()
            assert paths == {"serve": 1} and replica.actor_calls == 1  # no second wait on the actor
            assert poller.latest(*KEY).received_at == received
        finally:
            release.set()
            await poller.links.close()
            await replica.server.stop()
    asyncio.run(main())
