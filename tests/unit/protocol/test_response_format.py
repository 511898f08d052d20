"""response_format on both APIs: text, json_object and json_schema map onto SamplingParams.json_schema (plain
text that crosses the worker link); every bad value is a 400 naming its field, a schema the grammar backend
cannot enforce names response_format.json_schema.schema."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.api.contract import WorkerRequest
from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.sampling_params import SamplingParams, params_from_dict, params_to_dict
from pdserve.services.router.errors import from_validation_error
from pdserve.structured import JSON_OBJECT_SCHEMA
from pdserve.worklink.codec import pack_call, unpack_call

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer", "minimum": 1}, "a": {"enum": ["x", "y"]}},
          "required": ["b", "a"], "additionalProperties": False}
BODIES = [(ChatCompletionRequest, {"messages": MESSAGES}), (CompletionRequest, {"prompt": "x"})]


def _params(model, body, response_format) -> SamplingParams:
    return model.model_validate({**body, "response_format": response_format}).to_sampling_params(16)


def _error(model, body, response_format):
    with pytest.raises(ValidationError) as info:
        model.model_validate({**body, "response_format": response_format})
    return from_validation_error(info.value)


@pytest.mark.parametrize("model,body", BODIES)
def test_formats_map_to_the_schema_text(model, body):
    assert _params(model, body, {"type": "text"}).json_schema is None
    assert _params(model, body, None).json_schema is None
    assert _params(model, body, {"type": "json_object"}).json_schema == JSON_OBJECT_SCHEMA
    spec = {"type": "json_schema", "json_schema": {"name": "pair-1", "schema": SCHEMA, "strict": True,
                                                   "description": "a pair"}}
    text = _params(model, body, spec).json_schema
    assert text == '{"type":"object","properties":{"b":{"type":"integer","minimum":1},"a":{"enum":["x","y"]}},' \
                   '"required":["b","a"],"additionalProperties":false}'  # compact, property order kept


def test_the_constraint_crosses_the_worker_link_as_text():
    params = _params(*BODIES[0], {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
    assert params_from_dict(params_to_dict(params)) == params
    request, _, _ = unpack_call(pack_call(WorkerRequest("r", (1, 2), params)))
    assert request.params.json_schema == params.json_schema


@pytest.mark.parametrize("response_format,param,fragment", [
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}}},
     "response_format.json_schema.schema", "uniqueItems"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "strin"}}},
     "response_format.json_schema.schema", "strin"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"$ref": "#/$defs/none"}}},
     "response_format.json_schema.schema", "none"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": True}}, "response_format.json_schema.schema",
     "dictionary"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"maxLength": [{"enum": [], "x": ["é" * 60]}]}}},
     "response_format.json_schema.schema", "maxLength"),
    ({"type": "json_schema", "json_schema": {"name": "s"}}, "response_format.json_schema.schema", "required"),
    ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name", "required"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "response_format.json_schema.name",
     "pattern"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict", "boolean"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "extra": 1}},
     "response_format.json_schema.extra", "Extra"),
    ({"type": "json_schema"}, "response_format", "json_schema is required"),
    ({"type": "json_object", "json_schema": {"name": "s", "schema": SCHEMA}}, "response_format", "only with it"),
    ({"type": "regex"}, "response_format.type", "json_schema"),
    ({}, "response_format.type", "required"),
    ("json", "response_format", "dictionary"),
])
@pytest.mark.parametrize("model,body", BODIES)
def test_bad_formats_are_400s_naming_the_field(model, body, response_format, param, fragment):
    err = _error(model, body, response_format)
    assert err.status == 400 and err.param == param and err.code == "invalid_value", err.message
    assert err.message.startswith(param) and fragment in err.message, err.message
