"""Offline batch API over the engine core: submit everything, step until done."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import GenerationRequest
from pdserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        self.engine = LLMEngine(config or EngineConfig(**overrides))
        self._counter = 0

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self, prompts: list[list[int] | str], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        params = params or SamplingParams()
        per_request = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_request) != len(prompts):
            raise ValueError(f"{len(per_request)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, p in zip(prompts, per_request):
                token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                request_id = f"llm-{self._counter}"
                self._counter += 1
                self.engine.add_request(GenerationRequest(request_id, tuple(token_ids), p))
                ids.append(request_id)
        except BaseException:
            # a bad prompt rejects the whole batch; requests already added must not linger in the engine
            for request_id in ids:
                self.engine.abort(request_id)
            raise
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        done: dict[str, tuple[str | None, int]] = {}
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                tokens[delta.request_id].extend(delta.token_ids)
                texts[delta.request_id].append(delta.text)
                if delta.finished:
                    done[delta.request_id] = (delta.finish_reason, delta.num_cached_tokens)
        return [Completion(i, tokens[i], "".join(texts[i]), *done[i]) for i in ids]
