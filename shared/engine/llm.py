"""Offline batch API over the engine core: submit everything, step until done."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import GenerationRequest, TokenDelta
from pdserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[float] | None = None  # with SamplingParams.logprobs
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None
    prompt_logprobs: tuple[float | None, ...] | None = None  # with SamplingParams.prompt_logprobs
    prompt_top_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None


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
        deltas: dict[str, list[TokenDelta]] = {i: [] for i in ids}
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                deltas[delta.request_id].append(delta)
        return [_completion(i, deltas[i]) for i in ids]


def _completion(request_id: str, deltas: list[TokenDelta]) -> Completion:
    first, last = deltas[0], deltas[-1]
    with_logprobs = first.logprobs is not None
    return Completion(
        request_id, [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), last.finish_reason,
        last.num_cached_tokens,
        logprobs=[lp for d in deltas for lp in d.logprobs or ()] if with_logprobs else None,
        top_logprobs=[t for d in deltas for t in d.top_logprobs or ()] if with_logprobs else None,
        prompt_logprobs=first.prompt_logprobs, prompt_top_logprobs=first.prompt_top_logprobs,
    )
