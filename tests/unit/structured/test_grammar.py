"""Schemas to grammars with the llguidance backend: what compiles, what is refused and why, the cache, and
the masks on real vocabularies (allowed tokens, ids past the tokenizer, bounded whitespace, termination)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.structured import JSON_OBJECT_SCHEMA, GrammarCompiler, StructuredConfig, StructuredOutputError, \
    canonical_schema, check_json_schema, create_backend
from pdserve.structured.backend import allowed_ids, words_for

from .conftest import PERSON

INSTANCE = {"name": "Ada", "age": 36, "role": "admin", "address": {"city": "Paris", "zip": "75001"},
            "tags": ["math", "engines"]}


def compiler(vocab, **config) -> GrammarCompiler:
    return GrammarCompiler(StructuredConfig(**config), vocab)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def mask(matcher, vocab) -> np.ndarray:
    row = np.zeros(words_for(vocab.vocab_size), dtype=np.int32)
    matcher.fill_bitmask(row)
    return allowed_ids(row, vocab.vocab_size)


def test_canonical_text_is_compact_and_keeps_property_order():
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string"}}}
    text = check_json_schema(schema)
    assert text == canonical_schema(schema) == json.dumps(schema, separators=(",", ":"))
    assert text.index("zeta") < text.index("alpha")
    assert check_json_schema({"type": "object"}) == JSON_OBJECT_SCHEMA


@pytest.mark.parametrize("schema,fragment", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "strin"}, "strin"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "string", "pattern": "(("}, "regex"),
    ({"type": "array", "minItems": 5, "maxItems": 2}, "minItems"),
    ({"type": "string", "format": "no-such-format"}, "no-such-format"),
    # a schema's own x-guidance cannot turn unsupported keywords into silently ignored ones
    ({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}, "uniqueItems"),
])
def test_schemas_the_backend_cannot_enforce_are_refused_naming_why(schema, fragment):
    with pytest.raises(StructuredOutputError, match=fragment):
        check_json_schema(schema)


@pytest.mark.parametrize("schema", [True, [], "object", 1])
def test_a_schema_must_be_a_json_object(schema):
    with pytest.raises(StructuredOutputError, match="JSON object"):
        check_json_schema(schema)


def test_schemas_that_break_the_engine_or_nest_too_deep_are_refused_not_raised():
    """A Rust panic in llguidance (a BaseException, found by fuzzing: an error message cut inside a character)
    and a schema deeper than Python's stack would have escaped as a 500."""
    with pytest.raises(StructuredOutputError, match="broke the grammar engine"):
        check_json_schema({"maxLength": [{"enum": [], "additionalProperties": ["é" * 60]}]})
    deep = leaf = {}
    for _ in range(5000):
        leaf["items"] = {}
        leaf = leaf["items"]
    with pytest.raises(StructuredOutputError, match="nests deeper than 64 levels"):
        check_json_schema(deep)


def test_what_pydantic_and_openai_write_compiles():
    """$defs / $ref, anyOf (Optional), enums, const, titles and descriptions: a model's JSON schema."""
    schema = {
        "$defs": {"Address": {"properties": {"city": {"title": "City", "type": "string"}}, "required": ["city"],
                              "title": "Address", "type": "object", "additionalProperties": False}},
        "properties": {"address": {"$ref": "#/$defs/Address"},
                       "nick": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
                       "kind": {"const": "person"}, "n": {"type": "number", "exclusiveMinimum": 0},
                       "when": {"type": "string", "format": "date-time"}},
        "required": ["address", "nick", "kind", "n", "when"], "title": "Person", "type": "object",
        "description": "d", "additionalProperties": False,
    }
    assert check_json_schema(schema)


def test_compiled_grammars_are_cached_by_schema_and_bounded(tiny_vocab):
    grammars = compiler(tiny_vocab, max_cached_grammars=2)
    a, b, c = (canonical_schema({"type": "array", "maxItems": k}) for k in (1, 2, 3))
    first = grammars.grammar(a)
    assert grammars.grammar(a) is first and (grammars.num_compiles, grammars.num_hits) == (1, 1)
    grammars.grammar(b)
    grammars.grammar(c)  # evicts a, the least recently used
    assert grammars.num_cached == 2 and grammars.num_compiles == 3
    assert grammars.grammar(a) is not first and grammars.num_compiles == 4
    with pytest.raises(StructuredOutputError):
        grammars.grammar(canonical_schema({"type": "strin"}))
    assert grammars.num_cached == 2  # a failure is not cached


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown structured output backend 'nope'.*llguidance"):
        create_backend(StructuredConfig(backend="nope"), None)


def test_first_mask_allows_only_an_object_start_on_the_real_tokenizer(smollm2_tokenizer, smollm2_vocab):
    matcher = compiler(smollm2_vocab).matcher(canonical_schema(PERSON))
    allowed = mask(matcher, smollm2_vocab)
    assert 0 < len(allowed) < 100
    for token_id in allowed:
        assert smollm2_tokenizer.decode([int(token_id)], skip_special_tokens=False).startswith("{")
    assert not set(allowed) & set(smollm2_vocab.eos_token_ids)


def test_a_valid_instance_is_accepted_token_by_token_and_ends_the_grammar(smollm2_tokenizer, smollm2_vocab):
    matcher = compiler(smollm2_vocab).matcher(canonical_schema(PERSON))
    tokens = encode(smollm2_tokenizer, json.dumps(INSTANCE))  # json.dumps' separators: ", " and ": "
    for token in tokens:
        assert int(token) in set(mask(matcher, smollm2_vocab).tolist())
        assert not matcher.is_finished
        assert matcher.consume([token])
    assert matcher.is_finished  # nothing may follow the closing brace: the sequence stops there


@pytest.mark.parametrize("text", [
    '{"name": "Ada", "age": 17, ',  # below the minimum ("17" alone could go on to 170)
    '{"name": "Ada", "age": 36, "role": "root"',  # not in the enum
    '{"name": "Ada", "age": 36, "role": "admin", "address": {"city": "P", "zip": "1"}, "tags": []',  # minItems
    '{"x',  # no property starts so
])
def test_tokens_that_break_the_schema_are_refused(smollm2_tokenizer, smollm2_vocab, text):
    matcher = compiler(smollm2_vocab).matcher(canonical_schema(PERSON))
    assert not matcher.consume(encode(smollm2_tokenizer, text))
    assert matcher.error


def test_replay_resumes_or_refuses(smollm2_tokenizer, smollm2_vocab):
    grammars = compiler(smollm2_vocab)
    schema = canonical_schema(PERSON)
    head = encode(smollm2_tokenizer, '{"name": "Ada", "age": 3')
    resumed = grammars.matcher(schema, tuple(head))
    fresh = grammars.matcher(schema)
    fresh.consume(head)
    assert list(mask(resumed, smollm2_vocab)) == list(mask(fresh, smollm2_vocab))
    with pytest.raises(ValueError, match="do not follow the response format"):
        grammars.matcher(schema, tuple(encode(smollm2_tokenizer, '["a"]')))


def test_ids_past_the_tokenizer_are_never_allowed(tiny_vocab):
    """The tiny model's logits are 384 wide; its tokenizer names 262 ids."""
    assert tiny_vocab.vocab_size > tiny_vocab.num_tokens
    grammars = compiler(tiny_vocab)
    for schema in (JSON_OBJECT_SCHEMA, canonical_schema({"type": "string"})):
        matcher = grammars.matcher(schema)
        matcher.consume(list(b'{"k": "' if schema == JSON_OBJECT_SCHEMA else b'"'))  # inside a string: most allowed
        allowed = mask(matcher, tiny_vocab)
        assert len(allowed) > 100 and allowed.max() < tiny_vocab.num_tokens


def _accepts(grammars, text: bytes) -> bool:
    return grammars.matcher(canonical_schema({"type": "object", "properties": {"a": {"type": "integer"}}}))\
        .consume(list(text))


def test_whitespace_is_bounded(tiny_vocab):
    """Byte tokens (tiny) make every whitespace choice its own token."""
    fixed = compiler(tiny_vocab)  # default: no free whitespace, json.dumps' separators
    assert _accepts(fixed, b'{"a": 1}')
    assert not _accepts(fixed, b'{"a":1}') and not _accepts(fixed, b'{ "a": 1}') and not _accepts(fixed, b'{\n')
    bounded = compiler(tiny_vocab, max_whitespace=2)
    assert _accepts(bounded, b'{ "a" :1 }') and _accepts(bounded, b'{\n "a": 1}')
    assert not _accepts(bounded, b'{   "a"') and not _accepts(bounded, b'{"a":\n\n\n')
    # in the mask: after "{" and two blanks, a third is not allowed, a quote is
    matcher = bounded.matcher(JSON_OBJECT_SCHEMA)
    matcher.consume(list(b"{  "))
    allowed = set(mask(matcher, tiny_vocab).tolist())
    assert ord('"') in allowed and not allowed & {ord(" "), ord("\n"), ord("\t")}


def test_number_fraction_digits_are_bounded_where_the_schema_has_no_multiple_of(tiny_vocab):
    """A number schema without multipleOf admits at most max_fraction_digits fraction digits (a subset of what
    it allows), so a sampled number cannot run to max_tokens; multipleOf, const and enum values are untouched."""
    from pdserve.structured.formats import bound_fraction_digits

    schema = canonical_schema({"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10}, "y": {"type": ["number", "null"]},
        "z": {"type": "number", "multipleOf": 0.5}, "k": {"const": {"type": "number"}}}})
    bounded = json.loads(bound_fraction_digits(schema, 3))
    assert bounded["properties"]["x"]["multipleOf"] == 0.001 and bounded["properties"]["y"]["multipleOf"] == 0.001
    assert bounded["properties"]["z"]["multipleOf"] == 0.5 and bounded["properties"]["k"] == {"const": {"type": "number"}}
    assert bound_fraction_digits(schema, None) == schema
    number = canonical_schema({"type": "number"})
    for digits, text, accepted in [(3, "1.25", True), (3, "-0.125", True), (3, "0.1255", False),
                                   (None, "0.1255", True), (0, "12", True), (0, "1.5", False)]:
        matcher = compiler(tiny_vocab, max_fraction_digits=digits).matcher(number)
        ids = list(text.encode())  # the tiny model's tokens are bytes
        assert (matcher.validate(ids) == len(ids)) == accepted, (digits, text)
    with pytest.raises(ValueError, match="max_fraction_digits"):
        StructuredConfig(max_fraction_digits=17)


def test_draft_masks_walk_the_grammar_and_roll_it_back(smollm2_tokenizer, smollm2_vocab):
    """draft_bitmask's row i is the mask after draft[:i]; the matcher ends where it began, forced text is a
    draft the grammar accepts, and a draft is cut where the grammar refuses it."""
    from pdserve.structured.bitmask import draft_bitmask

    matcher = compiler(smollm2_vocab).matcher(canonical_schema(PERSON))
    forced = matcher.forced_tokens()
    assert forced and smollm2_tokenizer.decode(forced).startswith('{"name')
    text = encode(smollm2_tokenizer, json.dumps(INSTANCE))
    assert matcher.validate(text) == len(text) and matcher.validate(text[:5] + [0]) == 5
    rows = draft_bitmask(matcher, text[:5], smollm2_vocab.vocab_size)
    walker = compiler(smollm2_vocab).matcher(canonical_schema(PERSON))
    for i in range(6):
        assert np.array_equal(allowed_ids(rows[i], smollm2_vocab.vocab_size), mask(walker, smollm2_vocab))
        if i < 5:
            assert walker.consume(text[i : i + 1])
    assert np.array_equal(mask(matcher, smollm2_vocab), allowed_ids(rows[0], smollm2_vocab.vocab_size))
    assert matcher.consume(text) and matcher.is_finished
