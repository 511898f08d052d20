"""Workloads: exact lengths, determinism in the seed, ShareGPT parsing, Mooncake prefix sharing."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pdserve.loadtest.distributions import Fixed, LogNormal, Uniform, length_dist
from pdserve.loadtest.workloads import Mooncake, ShareGPT, Synthetic, TokenSource, workload

BYTES = TokenSource(tuple(range(256)), lambda text: list(text.encode("utf-8")))


@pytest.fixture(scope="module")
def tiny_tokens() -> TokenSource:
    return TokenSource.for_model("tiny")


def test_tiny_tokenizer_gives_only_ordinary_ids(tiny_tokens):
    assert tiny_tokens.ids == tuple(range(256))  # byte tokens; the special tokens follow at 256..261
    assert tiny_tokens.encode("hi")[-2:] == [ord("h"), ord("i")]


def test_synthetic_lengths_are_exact_and_deterministic(tiny_tokens):
    w = Synthetic(Uniform(10, 50), Fixed(7))
    a, b = w.requests(tiny_tokens, 30, seed=5), w.requests(tiny_tokens, 30, seed=5)
    assert a == b
    assert a != w.requests(tiny_tokens, 30, seed=6)
    assert all(10 <= r.prompt_len <= 50 and r.output_len == 7 for r in a)
    assert all(0 <= t < 256 for r in a for t in r.prompt_ids)
    # random prompts share no 16-token block: no accidental prefix-cache hits
    assert len({r.prompt_ids[:16] for r in a}) == len(a)


def test_lognormal_matches_its_mean_and_std():
    dist = LogNormal(1500, 600)
    sample = np.asarray(dist.sample(np.random.default_rng(0), 50_000))
    assert sample.mean() == pytest.approx(1500, rel=0.02)
    assert sample.std() == pytest.approx(600, rel=0.05)
    clipped = LogNormal(1500, 600, min_len=256, max_len=3500).sample(np.random.default_rng(0), 5000)
    assert min(clipped) >= 256 and max(clipped) <= 3500


def test_length_specs():
    assert length_dist(12) == Fixed(12)
    assert length_dist({"dist": "uniform", "low": 1, "high": 3}) == Uniform(1, 3)
    assert length_dist({"dist": "lognormal", "mean": 100, "std": 10, "max": 200}) == LogNormal(100, 10, 1, 200)
    with pytest.raises(ValueError):
        length_dist({"dist": "pareto"})
    with pytest.raises(ValueError):
        Uniform(5, 2)


def test_workload_registry():
    w = workload({"kind": "synthetic", "prompt": 8, "output": {"dist": "fixed", "value": 3}})
    assert w == Synthetic(Fixed(8), Fixed(3))
    with pytest.raises(ValueError):
        workload({"kind": "burstgpt"})


def test_sharegpt(tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "general kenobi"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "x"}]},  # too short
        {"conversations": [{"from": "human", "value": "what is up"}, {"from": "gpt", "value": "the sky, mostly"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    w = ShareGPT(str(path))
    reqs = w.requests(BYTES, 2, seed=1)
    assert reqs == w.requests(BYTES, 2, seed=1)
    assert sorted(r.output_len for r in reqs) == sorted([len("general kenobi"), len("the sky, mostly")])
    prompts = {bytes(r.prompt_ids[1:]) for r in reqs}  # after the one salt token
    assert prompts == {b"hello there", b"what is up"}
    assert ShareGPT(str(path), output_len=9).requests(BYTES, 1, 0)[0].output_len == 9
    with pytest.raises(ValueError):
        w.requests(BYTES, 3, seed=1)


def mooncake_file(tmp_path, records):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(path)


def test_mooncake_shared_hash_ids_are_shared_prefixes(tmp_path):
    records = [
        {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 500, "input_length": 1100, "output_length": 20, "hash_ids": [1, 2, 4]},
        {"timestamp": 2000, "input_length": 700, "output_length": 5, "hash_ids": [9, 2]},
        {"timestamp": 2500, "input_length": 900, "output_length": 5, "hash_ids": [1]},  # past its blocks
    ]
    w = Mooncake(mooncake_file(tmp_path, records))
    a, b, c, d = w.requests(BYTES, 4, seed=3)
    assert [r.prompt_len for r in (a, b, c, d)] == [1200, 1100, 700, 900]
    assert [r.output_len for r in (a, b, c, d)] == [10, 20, 5, 5]
    assert a.prompt_ids[:1024] == b.prompt_ids[:1024]
    assert a.prompt_ids[1024:1100] != b.prompt_ids[1024:1100]
    assert c.prompt_ids[:512] != a.prompt_ids[:512]
    assert c.prompt_ids[512:700] == a.prompt_ids[512:700]  # block 2, at a different position
    assert d.prompt_ids[:512] == a.prompt_ids[:512]
    assert w.requests(BYTES, 4, seed=3) == [a, b, c, d]
    salted = w.requests(BYTES, 4, seed=4)
    assert salted[0].prompt_ids[:512] != a.prompt_ids[:512]
    assert salted[0].prompt_ids[:1024] == salted[1].prompt_ids[:1024]
    assert w.arrivals(4).offsets == (0.0, 0.5, 2.0, 2.5)


def test_mooncake_caps(tmp_path):
    records = [{"timestamp": 7, "input_length": 3000, "output_length": 900, "hash_ids": [1, 2, 3, 4, 5, 6]}]
    w = Mooncake(mooncake_file(tmp_path, records), block_size=16, max_prompt_len=40, max_output_len=64)
    (r,) = w.requests(BYTES, 1, seed=0)
    assert r.prompt_len == 40 and r.output_len == 64
    assert w.arrivals(1).offsets == (0.0,)
