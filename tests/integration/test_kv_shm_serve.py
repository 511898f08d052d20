"""Prefill and decode as real Ray Serve deployments on one node: the default transport hands KV over through
shared memory, with the same greedy tokens as the engine alone and as the UCX path."""

from __future__ import annotations

import asyncio

import pytest
from pdserve.api.contract import FallbackNotice, TokenBatch, WorkerRequest
from pdserve.engine import LLM
from pdserve.sampling_params import SamplingParams
from pdserve.services.worker import WorkerConfig

pytest.importorskip("ray")
from pdserve.services.decode.app import build_app as build_decode
from pdserve.services.prefill.app import build_app as build_prefill

PROMPT = list(range(40, 140))  # 100 tokens: 7 blocks of 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pairs(ray_serve):
    """name -> (prefill, decode): the default config (shared memory on one node), and UCX only."""
    configs = {"shm": WorkerConfig(num_blocks=64, num_cpus=0.5),
               "ucx": WorkerConfig(num_blocks=64, num_cpus=0.5, kv_same_host=False)}
    handles = {}
    for name, config in configs.items():
        handles[name] = (ray_serve.run(build_prefill(config), name=f"shm-prefill-{name}", route_prefix=None),
                         ray_serve.run(build_decode(config), name=f"shm-decode-{name}", route_prefix=None))
    yield handles
    for name in configs:
        ray_serve.delete(f"shm-prefill-{name}")
        ray_serve.delete(f"shm-decode-{name}")


async def _disaggregated(prefill, decode, request_id: str, lose_handoff: bool = False) -> tuple[list[int], list]:
    request = WorkerRequest(request_id, tuple(PROMPT), GREEDY)
    first = await prefill.prefill.remote(request)
    assert first.handoff is not None
    handoff = first.handoff
    if lose_handoff:  # the client went before the pull: prefill forgets the lease on both paths
        await prefill.abort.remote(handoff.lease_id)
    events = [e async for e in decode.options(stream=True).generate.remote(request, handoff, first.first.token_ids[0])]
    return [*first.first.token_ids, *(t for e in events if isinstance(e, TokenBatch) for t in e.token_ids)], events


def _assert_all_blocks_free(*handles) -> None:
    for handle in handles:
        stats = handle.stats.remote().result()
        assert stats["num_free_blocks"] == stats["num_total_blocks"] and stats["num_leased_blocks"] == 0


def test_greedy_tokens_equal_the_engine_and_the_ucx_path_and_the_kv_took_shared_memory(pairs):
    expected = LLM(model="tiny", device="cpu", dtype="float32").generate([PROMPT], GREEDY)[0].token_ids
    tokens = {}
    for name, (prefill, decode) in pairs.items():
        tokens[name], events = asyncio.run(_disaggregated(prefill, decode, f"shm-r1-{name}"))
        assert not any(isinstance(e, FallbackNotice) for e in events)
        assert events[-1].finished
    assert tokens["shm"] == tokens["ucx"] == expected
    assert pairs["shm"][1].kv_transfer_stats.remote().result()["pulls_by_path"] == {"shm": 1}
    assert pairs["ucx"][1].kv_transfer_stats.remote().result()["pulls_by_path"] == {}  # a plain UCX transport
    for prefill, decode in pairs.values():
        for _ in range(50):  # the exporter releases once the importer's ack lands
            if prefill.kv_transfer_stats.remote().result()["num_exports"] == 0:
                break
            asyncio.run(asyncio.sleep(0.05))
        _assert_all_blocks_free(prefill, decode)


def test_a_forgotten_lease_falls_back_to_local_prefill_with_the_same_tokens(pairs):
    prefill, decode = pairs["shm"]
    expected = LLM(model="tiny", device="cpu", dtype="float32").generate([PROMPT], GREEDY)[0].token_ids
    before = decode.fallbacks.remote().result().get("transfer_failed", 0)
    tokens, events = asyncio.run(_disaggregated(prefill, decode, "shm-r2", lose_handoff=True))
    assert isinstance(events[0], FallbackNotice) and events[0].reason == "transfer_failed"
    assert "refused" in events[0].error  # the shared-memory exporter no longer serves the lease
    assert tokens == expected
    assert decode.fallbacks.remote().result()["transfer_failed"] == before + 1
    _assert_all_blocks_free(prefill, decode)
