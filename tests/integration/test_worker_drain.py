"""An autoscaled prefill replica chosen for removal drains (Serve awaits `__del__` within its graceful
shutdown): its link stops taking calls at once, but it holds its engine and KV transport open until the
KV it exported has been pulled or released, so no lease is stranded. Without autoscaling, shutdown does
not wait (the behaviour before). Run on the deployment class itself (no Serve), in this process."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve.kvcache.transports.ucx import UCXConfig, apply_ucx_env

apply_ucx_env(UCXConfig())  # before libucx loads
pytest.importorskip("ucxx")

from pdserve.api.contract import WorkerRequest  # noqa: E402
from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.services.prefill.app import PrefillDeployment  # noqa: E402
from pdserve.services.worker import WorkerConfig  # noqa: E402

PROFILE = LatencyProfile({"default": LatencyModel(prefill=PrefillModel(a=0.004, b=2e-3, c=0.0, d=0.0), decode=DecodeModel(
    a=0.02, b=0.1, c=0.0), kv_bytes_per_token=4096)}).to_dict()


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("autoscaled", [True, False], ids=["autoscaled", "fixed"])
def test_a_removed_prefill_replica_waits_for_its_exports(autoscaled):
    async def main():
        scaling = {"profile": PROFILE, "drain_timeout_s": 30.0} if autoscaled else None
        config = WorkerConfig(model="tiny", transport="ucx", ucx_host="127.0.0.1", num_blocks=64, num_cpus=1,
                              autoscaling=scaling).model_dump()
        prefill = PrefillDeployment.func_or_class(config)
        link = (await prefill.record_routing_stats())["link"]
        result = await prefill.prefill(WorkerRequest("r1", tuple(range(1, 40)), SamplingParams(max_tokens=8)))
        assert result.handoff is not None and prefill.transport.num_exports == 1
        stats = await prefill.record_autoscaling_stats()
        assert (stats["num_requests"], stats["prompt_tokens"]) == (1, 39)
        shutdown = asyncio.ensure_future(prefill.__del__())
        await asyncio.sleep(1.5)
        assert not _accepts(link)  # no new calls: the router goes elsewhere
        assert (await prefill.record_routing_stats())["link"] == link and not _accepts(link)  # stays stopped
        if not autoscaled:
            assert shutdown.done()  # as before: no wait for exports
            return
        assert not shutdown.done()  # the export is not yet pulled: the replica stays up
        assert len(prefill.engine.engine.leases) == 1
        assert await prefill.abort(result.handoff.lease_id)  # decode's side: pulled or released
        await asyncio.wait_for(shutdown, 10)
        assert prefill.transport.num_exports == 0 and len(prefill.engine.engine.leases) == 0

    asyncio.run(main())
