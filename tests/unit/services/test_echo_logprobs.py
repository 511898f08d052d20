"""echo with logprobs: the completion's logprobs object starts with the prompt's tokens (first logprob null),
in whole responses and in the first stream chunk; echo without logprobs is unchanged."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.api.contract import TokenBatch
from pdserve.models.tiny import ensure_tiny_checkpoint
from pdserve.models.tokenizer import Tokenizer
from pdserve.sampling_params import SamplingParams
from pdserve.services.router import openai_api as oa
from pdserve.services.router.admission import Prepared
from pdserve.services.router.streaming import sse_stream

PROMPT = "Hello world"
META = oa.ResponseMeta("cmpl-1", "tiny", chat=False)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny-echo")))


def _prepared(tokenizer, logprobs: int | None, stream: bool = False) -> Prepared:
    ids = tuple(tokenizer.encode(PROMPT))
    return Prepared(False, (ids,), SamplingParams(max_tokens=2, logprobs=logprobs), 1, stream, False,
                    logprobs is not None, 2.0, 0.2, "interactive", echo_texts=(PROMPT,))


def _events(tokenizer, prompt_ids) -> list[TokenBatch]:
    n = len(prompt_ids)
    prompt_lps = [None] + [-0.5 - i for i in range(n - 1)]
    prompt_tops = [None] + [[(prompt_ids[i + 1], -0.5 - i)] for i in range(n - 1)]
    a, b = (tokenizer.encode(s, add_special_tokens=False)[0] for s in (" more", "!"))
    return [
        TokenBatch((a,), tokenizer.decode([a]), logprobs=(-0.1,), top_logprobs=(((a, -0.1),),),
                   prompt_logprobs=tuple(prompt_lps), prompt_top_logprobs=tuple(prompt_tops)),
        TokenBatch((b,), tokenizer.decode([b]), logprobs=(-0.2,), top_logprobs=(((b, -0.2),),),
                   finished=True, finish_reason="length"),
    ]


def test_whole_response_leads_with_the_prompt(tokenizer):
    p = _prepared(tokenizer, logprobs=1)
    prompt_ids = p.prompts[0]
    choice = oa.Choice(0, p.echo_of(0), prompt_token_ids=p.echo_ids_of(0))
    for event in _events(tokenizer, prompt_ids):
        choice.add(event)
    body = oa.response_body(META, [choice], p.num_prompt_tokens, tokenizer, p.want_logprobs)
    (out,) = body["choices"]
    lp = out["logprobs"]
    n = len(prompt_ids)
    assert lp["tokens"][:n] == [tokenizer.decode([t], skip_special_tokens=False) for t in prompt_ids]
    assert len(lp["tokens"]) == n + 2 and out["text"].startswith(PROMPT)
    assert lp["token_logprobs"] == [None] + [-0.5 - i for i in range(n - 1)] + [-0.1, -0.2]
    assert lp["top_logprobs"][0] is None and all(isinstance(t, dict) for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # every token but a BOS the text lacks is spelled at its offset
    spelled = [(tok, at) for k, (tok, at) in enumerate(zip(lp["tokens"], lp["text_offset"]))
               if k >= n or tokenizer.decode([prompt_ids[k]], skip_special_tokens=True)]
    assert len(spelled) >= n + 1 and all(out["text"].startswith(tok, at) for tok, at in spelled)
    assert lp["text_offset"][n] == len(PROMPT)  # the generated text starts after the echoed prompt
    assert body["usage"]["completion_tokens"] == 2 and body["usage"]["prompt_tokens"] == n


def test_echo_without_logprobs_is_unchanged(tokenizer):
    p = _prepared(tokenizer, logprobs=None)
    assert p.echo_ids_of(0) == ()
    choice = oa.Choice(0, p.echo_of(0), prompt_token_ids=p.echo_ids_of(0))
    for event in _events(tokenizer, p.prompts[0]):
        choice.add(event)
    (out,) = oa.response_body(META, [choice], p.num_prompt_tokens, tokenizer, p.want_logprobs)["choices"]
    assert out["logprobs"] is None and out["text"].startswith(PROMPT)


def test_stream_sends_the_prompt_part_in_the_first_chunk(tokenizer):
    p = _prepared(tokenizer, logprobs=1, stream=True)
    prompt_ids = p.prompts[0]

    async def collect():
        async def events():
            for event in _events(tokenizer, prompt_ids):
                yield 0, event

        return [part async for part in sse_stream(META, p, events(), tokenizer)]

    parts = asyncio.run(collect())
    events = [e + b"\n\n" for e in b"".join(parts).split(b"\n\n") if e]  # a coalesced write holds several
    chunks = [json.loads(x[len(b"data: "):]) for x in events if x != oa.DONE]
    first, second = (c["choices"][0] for c in chunks)
    n = len(prompt_ids)
    assert first["text"].startswith(PROMPT) and len(first["logprobs"]["tokens"]) == n + 1
    assert first["logprobs"]["token_logprobs"][0] is None and first["logprobs"]["top_logprobs"][0] is None
    assert first["logprobs"]["token_logprobs"][-1] == -0.1 and first["logprobs"]["text_offset"][0] == 0
    assert second["logprobs"]["token_logprobs"] == [-0.2]
    assert second["logprobs"]["text_offset"] == [len(first["text"])]
