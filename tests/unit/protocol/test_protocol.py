"""Request validation and the mapping onto SamplingParams."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest


def test_completion_maps_every_sampling_field():
    req = CompletionRequest.model_validate({
        "model": "tiny", "prompt": "hi", "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0.5,
        "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "presence_penalty": 0.3,
        "frequency_penalty": -0.4, "seed": 3, "stop": "x", "stop_token_ids": [9], "ignore_eos": True,
        "min_tokens": 2, "logprobs": 3,
    })
    p = req.to_sampling_params(default_max_tokens=16)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (7, 0.5, 0.9, 5, 0.1)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.2, 0.3, -0.4)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos, p.min_tokens, p.logprobs) == (3, ("x",), (9,), True, 2, 3)


def test_defaults_and_chat_logprobs():
    req = ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    )
    p = req.to_sampling_params(default_max_tokens=16)
    assert p.max_tokens == 16 and p.logprobs == 2
    plain = ChatCompletionRequest.model_validate({"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert plain.to_sampling_params(16).logprobs is None


@pytest.mark.parametrize("body", [
    {"model": "tiny", "prompt": ""},
    {"model": "tiny", "prompt": []},
    {"model": "tiny", "prompt": "x", "max_tokens": 0},
    {"model": "tiny", "prompt": "x", "max_tokens": -3},
    {"model": "tiny", "prompt": "x", "temperature": 2.5},
    {"model": "tiny", "prompt": "x", "top_p": 0},
    {"model": "tiny", "prompt": "x", "n": 0},
    {"model": "tiny", "prompt": "x", "logprobs": 21},
    {"model": "tiny", "prompt": "x", "stop": [""]},
    {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}},
    {"model": "tiny", "prompt": "x", "unknown_field": 1},
    {"model": "tiny", "prompt": [1, -2]},
    {"model": "", "prompt": "x"},  # an absent model means the served one; an empty name is an error
])
def test_bad_completion_bodies_are_rejected(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


@pytest.mark.parametrize("body", [
    {"model": "tiny", "messages": []},
    {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]},
    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
])
def test_bad_chat_bodies_are_rejected(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_min_tokens_above_max_tokens_is_rejected():
    req = CompletionRequest.model_validate({"model": "tiny", "prompt": "x", "max_tokens": 2, "min_tokens": 5})
    with pytest.raises(ValueError, match="min_tokens"):
        req.to_sampling_params(16)
