"""A worker deployment closes what it opened when Serve shuts it down (Serve awaits `__del__`): its worker
link stops listening, its engine ends every open stream, and its UCX transport's listener goes. Run on
the deployment class itself (no Serve), so the checks see the same process."""

from __future__ import annotations

import asyncio
import socket

import pytest

from pdserve.kvcache.transports.ucx import UCXConfig, apply_ucx_env

apply_ucx_env(UCXConfig())  # before libucx loads
pytest.importorskip("ucxx")

from pdserve.api.contract import WorkerRequest  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.services.prefill.app import PrefillDeployment  # noqa: E402
from pdserve.services.worker import WorkerConfig  # noqa: E402


def _accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def test_prefill_deployment_closes_link_engine_and_transport():
    async def main():
        config = WorkerConfig(model="tiny", transport="ucx", ucx_host="127.0.0.1", num_blocks=64,
                              num_cpus=1).model_dump()
        prefill = PrefillDeployment.func_or_class(config)
        link = (await prefill.record_routing_stats())["link"]
        result = await prefill.prefill(WorkerRequest("r1", tuple(range(1, 40)), SamplingParams(max_tokens=8)))
        assert result.handoff is not None and _accepts(link)
        assert prefill.transport.num_exports == 1
        await prefill.__del__()
        assert not _accepts(link)
        # the UCX listener and the shared-memory socket are closed (the socket's name is free again)
        assert prefill.transport.remote._listener is None and prefill.transport.local._listener is None
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.bind("\0" + prefill.transport.local.address)
        probe.close()
        assert prefill.engine._loop_task is None or prefill.engine._loop_task.done()

    asyncio.run(main())
