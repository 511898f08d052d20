"""Ray Serve decode deployment: import a request's KV, adopt it, stream tokens; fall back to local prefill."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve import Application

from pdserve.engine.async_engine import AsyncLLMEngine
from pdserve.engine.outputs import GenerationRequest
from pdserve.kvcache.handoff import KVImporter
from pdserve.kvcache.params import HandoffParams
from pdserve.worker import WorkerConfig, build_transport, params_from_dict


@serve.deployment(name="decode")
class DecodeDeployment:
    def __init__(self, config: dict[str, Any], engine: AsyncLLMEngine | None = None) -> None:
        self.config = WorkerConfig.model_validate(config)
        self.engine = engine or AsyncLLMEngine.from_config(self.config.engine_config())
        self.importer = KVImporter(self.engine, build_transport(self.config, self.engine))

    async def generate(
        self, request: dict[str, Any], handoff: dict[str, Any] | None = None, first_token_id: int | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Streams TokenDelta dicts. With a handoff the first token came from prefill and is not repeated.
        A failed import is reported as a `fallback` event (never silently) and this worker prefills
        locally, continuing from the prompt plus prefill's first token, so the stream stays consistent
        (those events then count the first token in num_prompt_tokens)."""
        prompt = tuple(request["prompt_token_ids"])
        params = params_from_dict(request["params"])
        gen = GenerationRequest(request["request_id"], prompt, params)
        if handoff is not None:
            if first_token_id is None:
                raise ValueError("a handoff needs the first token prefill produced")
            result = await self.importer.import_kv(HandoffParams.from_dict(handoff))
            if result.ok:
                gen = dataclasses.replace(gen, adopt_lease_id=result.lease_id, first_token_id=first_token_id)
            else:
                yield {"fallback": result.fallback_reason, "error": result.error}
                rest = dataclasses.replace(
                    params, max_tokens=params.max_tokens - 1, min_tokens=max(0, params.min_tokens - 1)
                )
                gen = GenerationRequest(request["request_id"], (*prompt, first_token_id), rest)
        async for delta in self.engine.generate(gen):
            yield dataclasses.asdict(delta)

    def fallbacks(self) -> dict[str, int]:
        return dict(self.importer.fallbacks)

    def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.engine.stats())


def build_app(config: WorkerConfig | dict[str, Any]) -> Application:
    cfg = config if isinstance(config, WorkerConfig) else WorkerConfig.model_validate(config)
    return DecodeDeployment.options(**cfg.deployment_options()).bind(cfg.model_dump())
