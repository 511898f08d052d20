"""Prefill and decode as real Ray Serve deployments: KV moves between replica processes."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.api.contract import FallbackNotice, PrefillResult, TokenBatch, WorkerRequest
from pdserve.engine import LLM
from pdserve.sampling_params import SamplingParams
from pdserve.services.worker import WorkerConfig

pytest.importorskip("ray")
from pdserve.services.decode.app import build_app as build_decode  # noqa: E402
from pdserve.services.prefill.app import build_app as build_prefill  # noqa: E402

PROMPT = list(range(30, 75))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# seeded sampling: token j takes the seed's j-th draw wherever it is sampled (prefill draws the first)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
BOTH = pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])


@pytest.fixture(scope="module", params=["redis", "ucx"])
def workers(request, ray_serve, redis_server, tmp_path_factory):
    config = WorkerConfig(transport=request.param, redis_url=redis_server.url, num_blocks=64, num_cpus=1)
    prefill = ray_serve.run(build_prefill(config), name=f"prefill-{request.param}", route_prefix=None)
    decode = ray_serve.run(build_decode(config), name=f"decode-{request.param}", route_prefix=None)
    yield prefill, decode
    ray_serve.delete(f"prefill-{request.param}")
    ray_serve.delete(f"decode-{request.param}")


def _request(request_id: str, params: SamplingParams) -> WorkerRequest:
    return WorkerRequest(request_id, tuple(PROMPT), params)


async def _disaggregated(prefill, decode, request_id: str, params: SamplingParams) -> tuple[list[int], list]:
    first = await prefill.prefill.remote(_request(request_id, params))
    assert isinstance(first, PrefillResult) and first.first.num_tokens == 1 and not first.first.finished
    events = [
        e async for e in decode.options(stream=True).generate.remote(
            _request(request_id, params), first.handoff, first.first.token_ids[0]
        )
    ]
    tokens = [*first.first.token_ids] + [t for e in events if isinstance(e, TokenBatch) for t in e.token_ids]
    return tokens, events


@BOTH
def test_disaggregated_tokens_equal_the_engine_direct_output(workers, params):
    import asyncio

    prefill, decode = workers
    expected = LLM(model="tiny", device="cpu", dtype="float32").generate([PROMPT], params)[0].token_ids
    tokens, events = asyncio.run(_disaggregated(prefill, decode, f"r1-{params.temperature}", params))
    assert not any(isinstance(e, FallbackNotice) for e in events)
    assert tokens == expected
    assert events[-1].finished and events[-1].finish_reason == "length"
    # every KV block is back on both replicas: the prefill lease was released after the pull
    for handle in (prefill, decode):
        stats = handle.stats.remote().result()
        assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_leased_blocks"] == 0


@BOTH
def test_lost_handoff_falls_back_to_local_prefill_with_the_same_tokens(workers, params):
    import asyncio

    prefill, decode = workers
    expected = LLM(model="tiny", device="cpu", dtype="float32").generate([PROMPT], params)[0].token_ids
    request_id = f"r2-{params.temperature}"

    async def main():
        first = await prefill.prefill.remote(_request(request_id, params))
        # client gone before the pull (redis already released the lease once the blocks were stored)
        await prefill.abort.remote(first.handoff.lease_id)
        handoff = dataclasses.replace(first.handoff, block_hashes=[h ^ 1 for h in first.handoff.block_hashes])
        events = [
            e async for e in decode.options(stream=True).generate.remote(_request(request_id, params), handoff,
                                                                         first.first.token_ids[0])
        ]
        return first, events

    first, events = asyncio.run(main())
    assert events[0] == FallbackNotice("transfer_failed", events[0].error)
    tokens = [*first.first.token_ids] + [t for e in events[1:] for t in e.token_ids]
    assert tokens == expected
    assert decode.fallbacks.remote().result()["transfer_failed"] >= 1
    for handle in (prefill, decode):
        stats = handle.stats.remote().result()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
