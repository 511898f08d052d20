"""The engine: sequences, block manager, scheduler, model runner, sampler, and the engine loops.

The names below load on first use (PEP 562), so that importing a torch-free submodule (`outputs`, `lease`)
does not load the model runner and torch with it: Serve's driver imports the deployments' modules only to
bind them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncLLMEngine": "pdserve.engine.async_engine", "Completion": "pdserve.engine.llm",
    "LLM": "pdserve.engine.llm",
    "LLMEngine": "pdserve.engine.llm_engine", "EngineStats": "pdserve.engine.outputs",
    "GenerationRequest": "pdserve.engine.outputs", "KVHandoff": "pdserve.engine.outputs",
    "TokenDelta": "pdserve.engine.outputs",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from pdserve.engine.async_engine import AsyncLLMEngine
    from pdserve.engine.llm import LLM, Completion
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.outputs import EngineStats, GenerationRequest, KVHandoff, TokenDelta


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pdserve.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
