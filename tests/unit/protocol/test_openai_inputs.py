"""OpenAI inputs beyond the basics: prompt batches, logit_bias, echo, stream_options, refused fields.
Each bad value is a 400 whose `param` names the field (via the router's error mapping)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.api.protocol import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest
from pdserve.services.router.errors import from_validation_error

MESSAGES = [{"role": "user", "content": "hi"}]


def _error(model, body):
    with pytest.raises(ValidationError) as info:
        model.model_validate({"model": "tiny", **body})
    return from_validation_error(info.value)


@pytest.mark.parametrize("prompt,batch", [
    ("hi", ["hi"]), ([1, 2], [[1, 2]]), (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_shapes_become_a_batch(prompt, batch):
    assert CompletionRequest.model_validate({"model": "tiny", "prompt": prompt}).prompts == batch


@pytest.mark.parametrize("prompt", [
    [], [""], ["a", ""], [[]], [[1], []], [[1, -2]], [1, "a"], [["a"]], [[1], "a"], {"a": 1}, 3,
    ["x"] * (MAX_PROMPTS + 1),
])
def test_bad_prompts_name_prompt(prompt):
    err = _error(CompletionRequest, {"prompt": prompt})
    assert err.status == 400 and err.param == "prompt", err.message


def test_logit_bias_maps_to_params():
    req = CompletionRequest.model_validate({"model": "tiny", "prompt": "x", "logit_bias": {"5": 100, "2": -1.5}})
    assert req.to_sampling_params(16).logit_bias == ((2, -1.5), (5, 100.0))


@pytest.mark.parametrize("bias", [{"x": 1}, {"-1": 1}, {"1": 100.5}, {"1": -101}, {"1": "a"},
                                  {str(i): 1 for i in range(301)}])
def test_bad_logit_bias_names_logit_bias(bias):
    for model, body in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": MESSAGES})):
        err = _error(model, {**body, "logit_bias": bias})
        assert err.param.split(".")[0] == "logit_bias", err.message  # logit_bias.<key> for a bad value type


def test_stream_options_accept_continuous_usage_and_ignore_unknown_keys():
    req = CompletionRequest.model_validate({"model": "tiny", "prompt": "x", "stream": True, "stream_options": {
        "include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False}})
    assert req.stream_options.include_usage and req.stream_options.continuous_usage_stats


@pytest.mark.parametrize("body,param", [
    ({"suffix": "tail"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"n": 2, "best_of": 3}, "best_of"),
])
def test_unsupported_completion_fields_are_named(body, param):
    err = _error(CompletionRequest, {"prompt": "x", **body})
    assert err.param == param and err.code == "unsupported_parameter"
    assert "not supported" in err.message and err.message.startswith(param)


def test_tools_are_accepted_and_a_choice_without_them_is_named():
    req = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "f"}}]})
    assert req.tool_plan.mode == "auto" and req.tool_plan.names == ("f",)
    err = _error(ChatCompletionRequest, {"messages": MESSAGES, "tool_choice": "auto"})
    assert err.param == "tool_choice" and err.code == "invalid_value" and "needs tools" in err.message


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    def params(**body):
        return CompletionRequest.model_validate({"prompt": "x", **body}).to_sampling_params(16)

    assert params(echo=True, logprobs=2).prompt_logprobs == 2 and params(echo=True, logprobs=2).logprobs == 2
    assert params(echo=True, logprobs=0).prompt_logprobs == 0
    assert params(logprobs=2).prompt_logprobs is None and params(echo=True).prompt_logprobs is None


def test_accepted_no_op_values():
    CompletionRequest.model_validate({"model": "tiny", "prompt": "x", "suffix": None, "best_of": 2, "n": 2,
                                      "echo": True, "user": "u-1"})
    ChatCompletionRequest.model_validate({"model": "tiny", "messages": MESSAGES, "tools": [], "tool_choice": "none",
                                          "response_format": {"type": "text"}, "user": "u-1"})


def test_chat_content_as_text_parts_and_model_optional():
    from pdserve.api.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]})
    assert req.model is None
    assert [m.for_template() for m in req.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def test_non_text_content_parts_are_refused_by_name():
    from pdserve.api.protocol import ChatCompletionRequest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="only text parts"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text"}]}]})
