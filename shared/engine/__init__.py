"""The engine: sequences, block manager, scheduler, model runner, sampler, and the engine loops."""

from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.llm import LLM, Completion
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import EngineStats, GenerationRequest, KVHandoff, TokenDelta

__all__ = [
    "AsyncLLMEngine", "Completion", "EngineStats", "GenerationRequest", "KVHandoff", "LLM", "LLMEngine",
    "TokenDelta",
]
