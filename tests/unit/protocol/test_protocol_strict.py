"""Inputs the fuzzers (tests/integration/test_fuzz_*.py) found reaching past validation: lone surrogates,
booleans standing in for numbers, integers too large for the worker codec. Each is a 400 with a clean message."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest, has_lone_surrogates
from pdserve.services.router.errors import from_validation_error


def _rejected(model, body: dict) -> dict:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    err = from_validation_error(info.value)
    assert err.status == 400
    return err.body()["error"]


@pytest.mark.parametrize("body", [
    {"prompt": "ok \ud927 not text"},
    {"prompt": "ok", "stop": ["\udc00"]},
    {"prompt": "ok", "user": "\ud800"},
    {"prompt": "ok", "\udfff": 1},  # an unknown key: its name would be echoed back as the error's param
    {"prompt": "ok", "logit_bias": {"\ud800": 1.0}},
])
def test_lone_surrogates_are_refused_before_anything_echoes_or_tokenizes_them(body):
    error = _rejected(CompletionRequest, body)
    assert error["param"] is None and "surrogate" in error["message"]
    error["message"].encode("utf-8")  # the response can carry it


def test_surrogate_pairs_are_text():
    body = json.loads('{"prompt": "\\ud83d\\ude00", "k": ["\\ud83d\\ude00"]}')  # JSON pairs the escapes
    assert not has_lone_surrogates(body)
    assert CompletionRequest.model_validate({"prompt": body["prompt"]}).prompt == "\U0001f600"
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}
    assert "surrogate" in _rejected(ChatCompletionRequest, chat)["message"]


@pytest.mark.parametrize("field,value", [
    ("max_tokens", True), ("n", True), ("temperature", False), ("frequency_penalty", False), ("seed", True),
    ("stream", 1), ("echo", "yes"), ("ignore_eos", 0), ("logprobs", True), ("top_k", 1.5), ("n", "2"),
])
def test_numbers_and_flags_are_strict(field, value):
    error = _rejected(CompletionRequest, {"prompt": "ok", field: value})
    assert error["param"] == field


def test_an_integer_may_be_written_as_a_whole_float():
    req = CompletionRequest.model_validate({"prompt": [1.0, 2], "max_tokens": 4.0, "n": 2.0, "stop_token_ids": [3.0]})
    assert req.prompt == [1, 2] and req.max_tokens == 4 and req.n == 2 and req.stop_token_ids == [3]
    assert all(type(v) is int for v in (*req.prompt, req.max_tokens, req.n))


@pytest.mark.parametrize("body,message", [
    ({"prompt": ""}, "prompt must not be empty"), ({"prompt": []}, "prompt must not be empty"),
    ({"prompt": ["a", ""]}, "prompt must not be empty"), ({"prompt": [[1], []]}, "prompt must not be empty"),
    ({"prompt": ["a"] * 65}, "at most 64 prompts"), ({"prompt": [1, -1]}, "non-negative"),
    ({"prompt": [["a"], 1]}, "prompt must be a string, a list of token ids"),
])
def test_prompt_errors_say_what_is_wrong(body, message):
    error = _rejected(CompletionRequest, body)
    assert error["param"] == "prompt" and message in error["message"]


@pytest.mark.parametrize("body,param", [
    ({"prompt": [True, False]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [[1], [2**31]]}, "prompt"),
    ({"prompt": "ok", "stop_token_ids": [2**64]}, "stop_token_ids.0"),
    ({"prompt": "ok", "top_k": 24662892082434629991137280}, "top_k"),
    ({"prompt": "ok", "slo": {"ttft_ms": 5e-324}}, "slo.ttft_ms"),  # 0 s once in seconds: the placer refused it
    ({"prompt": "ok", "slo": {"tpot_ms": 0.5}}, "slo.tpot_ms"),
])
def test_values_the_router_cannot_carry_are_refused(body, param):
    assert _rejected(CompletionRequest, body)["param"] == param


def test_validator_messages_carry_no_pydantic_prefix():
    error = _rejected(CompletionRequest, {"prompt": "ok", "stop": [""]})
    assert error["message"] == "stop: at most 8 non-empty strings of at most 256 characters"
    error = _rejected(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert error["message"] == "top_logprobs requires logprobs to be true"


def test_the_json_schema_carries_every_bound():
    """The OpenAPI document (and so schemathesis, and clients) sees each bound as JSON Schema."""
    for model in (CompletionRequest, ChatCompletionRequest):
        text = json.dumps(model.model_json_schema())
        assert not any(f'"{key}":' in text for key in ("ge", "le", "gt", "lt")), text
    prompt = json.dumps(CompletionRequest.model_json_schema()["properties"]["prompt"])
    assert '"minItems": 1' in prompt and '"minLength": 1' in prompt and '"minimum": 0' in prompt
