"""AsyncLLMEngine on the tiny model: the engine, requests and the waits its tests share."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine import AsyncLLMEngine, GenerationRequest, LLMEngine, TokenDelta
from pdserve.models.tiny import ensure_tiny_checkpoint
from pdserve.sampling_params import SamplingParams

NUM_BLOCKS = 48
GREEDY = dict(temperature=0.0, ignore_eos=True)
SETTLE_S = 10.0


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny-async"))


def make_engine(tiny_dir: Path, **scheduler) -> AsyncLLMEngine:
    return AsyncLLMEngine(LLMEngine(EngineConfig(
        model=str(tiny_dir), device="cpu", dtype="float32",
        cache=CacheConfig(num_blocks=NUM_BLOCKS, block_size=16), scheduler=SchedulerConfig(**scheduler),
    )))


def request(request_id: str, prompt: bytes, max_tokens: int = 8, **params) -> GenerationRequest:
    sampling = SamplingParams(max_tokens=max_tokens, **(GREEDY | params))
    return GenerationRequest(request_id, tuple(prompt), sampling)


async def collect(engine: AsyncLLMEngine, req: GenerationRequest) -> list[TokenDelta]:
    return [delta async for delta in engine.generate(req)]


def tokens_of(stream: list[TokenDelta]) -> list[int]:
    return [t for d in stream for t in d.token_ids]


def is_idle(engine: AsyncLLMEngine) -> bool:
    core = engine.engine
    return not core.requests and core.block_manager.num_free_blocks == NUM_BLOCKS and not engine._queues


async def settle(engine: AsyncLLMEngine) -> None:
    """Waits (bounded) until every request is gone and the whole pool is free."""
    for _ in range(int(SETTLE_S / 0.01)):
        if is_idle(engine):
            return
        await asyncio.sleep(0.01)
    core = engine.engine
    free, queues = core.block_manager.num_free_blocks, list(engine._queues)
    pytest.fail(f"engine did not settle: requests={list(core.requests)} free={free} queues={queues}")


PROMPTS = [b"first prompt", b"the second, somewhat longer prompt of the batch", b"3", b"fourth prompt here"]
MAX_TOKENS = [12, 5, 9, 16]
