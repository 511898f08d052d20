"""The router's Workers: a call goes over a replica's worker link once the stats poller knows it (and it
still answers), else through Serve's handle; the caller never chooses."""

from __future__ import annotations

import dataclasses
import time

from pdserve.api.contract import HandoffParams, WorkerRequest
from pdserve.sampling_params import SamplingParams
from pdserve.services.router.replica_stats import ReplicaStatsPoller
from pdserve.services.router.workers import Workers
from pdserve.worklink import LinkClient


class RecordingLinks(LinkClient):
    """The link client's call surface, recording instead of connecting."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def prefill(self, link, request):
        self.calls.append(("prefill", link.address, request.request_id))

    def generate(self, link, request, *handoff):
        self.calls.append(("generate", link.address, request.request_id, len(handoff)))

    def abort(self, link, lease_id):
        self.calls.append(("abort", link.address, lease_id))


class Method:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def remote(self, *args):
        self.log.append((self.name, *args))


class Handle:
    """A deployment handle's call surface, recording the calls Serve would route."""

    def __init__(self):
        self.log = []

    def options(self, **kw):
        return self

    def __getattr__(self, name):
        return Method(self.log, name)


def _workers(links):
    poller = ReplicaStatsPoller("app", ("prefill", "decode"), staleness_s=1.0, links=links)
    poller._store(("prefill", "p-link"), {"link": "127.0.0.1:7001", "link_token": "t"})
    poller._store(("decode", "d-link"), {"link": "127.0.0.1:7002", "link_token": "t"})
    poller._store(("decode", "d-serve"), {})
    counted = []
    return Workers(Handle(), Handle(), poller, lambda role, path: counted.append((role, path))), counted


def _request(replica):
    return WorkerRequest("r", (1, 2, 3), SamplingParams(max_tokens=4), replica=replica)


HANDOFF = HandoffParams("ucx", 1, "lease-1", 3, (0,))


def test_a_replica_with_a_known_link_is_called_over_it():
    links = RecordingLinks()
    workers, counted = _workers(links)
    workers.prefill(_request("p-link"))
    workers.generate(_request("d-link"), HANDOFF, 7)
    workers.abort("p-link", "lease-1")
    assert links.calls == [("prefill", "127.0.0.1:7001", "r"), ("generate", "127.0.0.1:7002", "r", 2),
                           ("abort", "127.0.0.1:7001", "lease-1")]
    assert workers.prefill_handle.log == [] and workers.decode_handle.log == []
    assert counted == [("prefill", "link"), ("decode", "link")]


def test_no_link_no_replica_or_a_stale_one_goes_through_serve():
    links = RecordingLinks()
    workers, counted = _workers(links)
    workers.generate(_request("d-serve"))
    workers.generate(_request(None))
    key = ("prefill", "p-link")  # stale: the replica stopped answering
    workers.poller._latest[key] = dataclasses.replace(workers.poller._latest[key], received_at=time.monotonic() - 10)
    assert workers.live("prefill") == []
    workers.prefill(_request("p-link"))
    assert links.calls == []
    assert [c[0] for c in workers.decode_handle.log] == ["generate", "generate"]
    assert [c[0] for c in workers.prefill_handle.log] == ["prefill"]
    assert counted == [("decode", "serve"), ("decode", "serve"), ("prefill", "serve")]


def test_the_link_off_sends_everything_through_serve():
    workers, _ = _workers(None)
    workers.generate(_request("d-link"), HANDOFF, 7)
    workers.abort("p-link", "lease-1")
    assert workers.decode_handle.log[0][0] == "generate" and len(workers.decode_handle.log[0]) == 4
    assert workers.prefill_handle.log == [("abort", "lease-1")]


def test_a_forgotten_replica_loses_its_link():
    links = RecordingLinks()
    workers, _ = _workers(links)
    workers.forget("decode", "d-link")
    assert workers.link("decode", "d-link") is None
