"""response_format through the engine on the tiny model (random weights, so the schemas here have finite
languages): masks applied in the batched sampler, termination, max_tokens, the prefill -> decode handoff
and a resumed stream replaying the grammar, speculative drafts checked against the grammar, and
unconstrained rows untouched."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pdserve.config import CacheConfig, EngineConfig, SpeculativeConfig
from pdserve.engine import GenerationRequest, LLMEngine, TokenDelta
from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams
from pdserve.structured import canonical_schema
from pdserve.structured.backend import allowed_ids
from pdserve.structured.bitmask import apply_bitmask, fill_bitmask

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "yy", "zzz"]}, "b": {"type": "boolean"},
                                           "c": {"type": "array", "items": {"enum": [1, 22]}, "maxItems": 3}},
          "required": ["a", "b", "c"], "additionalProperties": False}
SCHEMA_TEXT = canonical_schema(SCHEMA)
MAX_TOKENS = 64  # the longest value: {"a": "zzz", "b": false, "c": [22, 22, 22]} is 43 byte tokens


def make_engine(tiny_dir, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_dir), device="cpu", dtype="float32",
                                  cache=CacheConfig(num_blocks=64, block_size=16), **config))


@pytest.fixture(scope="module")
def engine(tiny_dir) -> LLMEngine:
    return make_engine(tiny_dir)


def params(**overrides) -> SamplingParams:
    return SamplingParams(**({"max_tokens": MAX_TOKENS, "temperature": 0.0, "json_schema": SCHEMA_TEXT}
                             | overrides))


def prompt_of(salt: int, length: int = 20) -> tuple[int, ...]:
    return tuple((31 * i + 7 * salt + 3) % 250 for i in range(length))


def run(engine: LLMEngine, *requests: GenerationRequest) -> dict[str, list[TokenDelta]]:
    for request in requests:
        engine.add_request(request)
    out: dict[str, list[TokenDelta]] = {r.request_id: [] for r in requests}
    for _ in range(1000):
        if not engine.has_unfinished():
            break
        for delta in engine.step():
            out[delta.request_id].append(delta)
    assert not engine.has_unfinished()
    return out


def tokens(stream: list[TokenDelta]) -> list[int]:
    return [t for d in stream for t in d.token_ids]


def text(stream: list[TokenDelta]) -> str:
    return "".join(d.text for d in stream)


def test_outputs_validate_and_stop_when_the_value_is_complete(engine):
    """Greedy and sampled, eos ignored or not: each output is one valid value, ended by the grammar."""
    requests = [GenerationRequest(f"r{k}", prompt_of(k), params(**extra)) for k, extra in enumerate([
        {}, {"ignore_eos": True}, *({"temperature": 1.0, "seed": s} for s in range(4)),
        {"temperature": 1.5, "top_p": 0.9, "seed": 9}, {"temperature": 1.0}])]
    for stream in run(engine, *requests).values():
        jsonschema.validate(json.loads(text(stream)), SCHEMA)
        assert stream[-1].finish_reason == "stop" and stream[-1].stop_reason is None
        assert len(tokens(stream)) < MAX_TOKENS


def test_json_object_mode_yields_an_object(engine):
    schema = canonical_schema({"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"],
                               "additionalProperties": False})
    (stream,) = run(engine, GenerationRequest("o", prompt_of(3), params(json_schema=schema))).values()
    assert isinstance(json.loads(text(stream)), dict)


def test_max_tokens_under_a_schema_is_length_not_an_error(engine):
    (stream,) = run(engine, GenerationRequest("short", prompt_of(1), params(max_tokens=5))).values()
    (full,) = run(engine, GenerationRequest("full", prompt_of(1), params())).values()
    assert stream[-1].finish_reason == "length" and len(tokens(stream)) == 5
    assert text(full).startswith(text(stream))  # the same path, cut short


def test_unconstrained_rows_are_untouched(engine):
    """A greedy unconstrained request gives the same tokens alone as beside constrained ones, and a batch
    with no constraint is processed without a copy for grammars."""
    free = GenerationRequest("free", prompt_of(5), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    alone = tokens(run(engine, free)["free"])
    mixed = run(engine, dataclasses.replace(free, request_id="free2"),
                *(GenerationRequest(f"c{k}", prompt_of(k), params()) for k in range(3)))
    assert tokens(mixed["free2"]) == alone
    seqs = [Sequence("u", [1, 2], SamplingParams(temperature=0.0), 16)]
    logits = torch.randn(1, 384)
    assert Sampler.process(logits, seqs)[1] is logits


def test_the_mask_is_applied_in_the_batched_sampler(engine):
    """Row by row: a constrained row keeps exactly what its grammar allows, at the same values; the
    unconstrained row in between is unchanged."""
    grammars = engine.grammars
    seqs = [Sequence("a", [1], params(), 16), Sequence("u", [1], SamplingParams(), 16),
            Sequence("b", [1], params(), 16)]
    seqs[0].grammar = grammars.matcher(SCHEMA_TEXT)
    seqs[2].grammar = grammars.matcher(SCHEMA_TEXT, tuple(b'{"a": "'))
    logits = torch.randn(3, 384)
    out = Sampler.process(logits, seqs)[1]
    assert torch.equal(out[1], logits[1])
    for row, token_ids in ((0, [ord("{")]), (2, [ord("x"), ord("y"), ord("z")])):
        allowed = out[row] > float("-inf")
        assert allowed.nonzero().flatten().tolist() == token_ids
        assert torch.equal(out[row][allowed], logits[row][allowed])
    bitmask = fill_bitmask([seq.grammar for seq in seqs], 384)
    assert allowed_ids(bitmask[2], 384).tolist() == [ord("x"), ord("y"), ord("z")]
    assert len(allowed_ids(bitmask[1], 384)) == 384  # unconstrained: every bit set
    assert torch.equal(apply_bitmask(logits, bitmask), out)  # what Sampler.process did
    # a sampled token is always an allowed one, also at high temperature over many seeds
    sampled = [Sampler(seed)(logits[2:].clone() * 0, [dataclasses.replace(seqs[2], params=params(temperature=2.0))])
               .token_ids[0] for seed in range(30)]
    assert set(sampled) <= {ord("x"), ord("y"), ord("z")}


def test_prefill_samples_the_first_token_and_decode_resumes_the_grammar(engine, tiny_dir):
    """Split: the prefill engine's first token is constrained; the adopting engine replays it. Fallback: a
    decode that prefills locally with the first token as a resumed tail replays it too. Both give what one
    engine gives, sampled (seeded) as well as greedy."""
    reference = make_engine(tiny_dir)
    for k, sampling in enumerate([params(), params(temperature=1.0, seed=11)]):
        prompt = prompt_of(20 + k, length=40)
        plain = tokens(run(reference, GenerationRequest("plain", prompt, sampling))["plain"])
        (pre,) = run(engine, GenerationRequest("pre", prompt, sampling, prefill_only=True))["pre"]
        assert pre.kv_handoff is not None and list(pre.token_ids) == plain[:1] == [ord("{")]
        adopted = GenerationRequest("dec", prompt, sampling, adopt_lease_id=pre.kv_handoff.lease_id,
                                    first_token_id=pre.token_ids[0])
        rest = run(engine, adopted)["dec"]
        assert [*pre.token_ids, *tokens(rest)] == plain and not engine.leases.leases
        assert rest[-1].finish_reason == "stop"
        local = GenerationRequest("local", (*prompt, plain[0]), dataclasses.replace(sampling, max_tokens=MAX_TOKENS - 1),
                                  rng_offset=1, num_resumed_tokens=1)
        assert [plain[0], *tokens(run(reference, local)["local"])] == plain


def test_a_migrated_stream_resumes_mid_value(engine):
    """Decode migration resends the output so far as the prompt's resumed tail: the grammar replays it."""
    prompt = prompt_of(30)
    plain = tokens(run(engine, GenerationRequest("plain", prompt, params()))["plain"])
    sent = plain[:7]
    resumed = GenerationRequest("moved", (*prompt, *sent), params(max_tokens=MAX_TOKENS - len(sent)),
                                num_resumed_tokens=len(sent), rng_offset=len(sent))
    assert [*sent, *tokens(run(engine, resumed)["moved"])] == plain


def test_output_that_breaks_the_schema_cannot_be_resumed(engine):
    prompt = prompt_of(31)
    bad = GenerationRequest("bad", (*prompt, *b"[1"), params(), num_resumed_tokens=2)
    with pytest.raises(ValueError, match="do not follow the response format"):
        engine.add_request(bad)
    assert not engine.requests and engine.scheduler.num_waiting == 0


def test_constrained_drafts_follow_the_grammar_and_match_decoding_without_drafts(tiny_dir):
    """Constrained rows draft (grammar-trimmed n-grams, else the text the grammar forces); each verification
    row is masked by the grammar after its draft prefix, and the matcher is rolled back before the accepted
    tokens are consumed: greedy output is token for token what decoding without speculation gives, beside an
    unconstrained row that drafts, and sampled output still validates."""
    spec = make_engine(tiny_dir, speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                                                prompt_lookup_max=2))
    plain = make_engine(tiny_dir)
    copying = GenerationRequest("copy", (5, 6, 7) * 12, SamplingParams(max_tokens=24, temperature=0.0,
                                                                       ignore_eos=True))
    constrained = [GenerationRequest(f"json{k}", prompt_of(40 + k), params()) for k in range(3)]
    expected = run(plain, copying, *constrained)
    got = run(spec, copying, *constrained)
    for request in constrained:
        stream = got[request.request_id]
        assert tokens(stream) == tokens(expected[request.request_id])
        assert stream[-1].num_draft_tokens > 0 and stream[-1].num_accepted_tokens > 0
        jsonschema.validate(json.loads(text(stream)), SCHEMA)
    assert got["copy"][-1].num_draft_tokens > 0
    sampled = [GenerationRequest(f"s{k}", prompt_of(50 + k), params(temperature=1.0, seed=k)) for k in range(6)]
    for stream in run(spec, *sampled).values():
        jsonschema.validate(json.loads(text(stream)), SCHEMA)
        assert stream[-1].finish_reason == "stop"
    assert not spec.requests and spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


