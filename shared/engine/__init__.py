"""The engine: sequences, block manager, scheduler, model runner, sampler, and the engine loops.

The names below load on first use (PEP 562), so that importing a torch-free submodule (`outputs`, `lease`)
does not load the model runner and torch with it: Serve's driver imports the deployments' modules only to
bind them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_MODULES = {  # submodule -> the names it exports here
    "async_engine": ("AsyncLLMEngine",),
    "llm": ("LLM", "Completion"),
    "llm_engine": ("LLMEngine",),
    "outputs": ("EngineStats", "GenerationRequest", "KVHandoff", "TokenDelta"),
}
_EXPORTS = {name: f"pdserve.engine.{module}" for module, names in _MODULES.items() for name in names}
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
