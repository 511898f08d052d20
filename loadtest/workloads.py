"""Workloads: what each request sends (prompt token ids, exact output length), seeded and deterministic.

Prompts go out as token-id lists built from the target's tokenizer, so prompt lengths are exact;
output lengths are exact too because requests carry ignore_eos and min_tokens == max_tokens.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pdserve.loadtest.arrivals import Trace
from pdserve.loadtest.distributions import LengthDist, length_dist


@dataclass(frozen=True)
class RequestSpec:
    prompt_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class TokenSource:
    """A tokenizer's ordinary (non-special) token ids and its text encoder."""

    ids: tuple[int, ...]
    encode: Callable[[str], list[int]]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TokenSource:
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True).values()
        ids = tuple(sorted(i for i in vocab if i not in tokenizer.special_token_ids))
        return cls(ids, tokenizer.encode)

    @classmethod
    def for_model(cls, model: str) -> TokenSource:
        from pdserve.models.resolve import resolve_model_path
        from pdserve.models.tokenizer import Tokenizer

        return cls.from_tokenizer(Tokenizer.from_dir(resolve_model_path(model)))

    def random_ids(self, rng: np.random.Generator, n: int) -> tuple[int, ...]:
        return tuple(int(i) for i in rng.choice(np.asarray(self.ids), size=n))


class Workload(ABC):
    @abstractmethod
    def requests(self, tokens: TokenSource, n: int, seed: int) -> list[RequestSpec]:
        """n requests; the same seed gives the same requests."""

    def arrivals(self, n: int) -> Trace | None:
        """The workload's own arrival schedule (a trace), or None to use an arrival process."""
        return None


@dataclass(frozen=True)
class Synthetic(Workload):
    prompt: LengthDist
    output: LengthDist

    def requests(self, tokens: TokenSource, n: int, seed: int) -> list[RequestSpec]:
        rng = np.random.default_rng(seed)
        prompt_lens, output_lens = self.prompt.sample(rng, n), self.output.sample(rng, n)
        return [RequestSpec(tokens.random_ids(rng, p), o) for p, o in zip(prompt_lens, output_lens)]


@dataclass(frozen=True)
class ShareGPT(Workload):
    """First human turn as the prompt, the reply's token count as the output length (`vllm bench serve`).

    Each prompt starts with one random token drawn from the seed, so replaying the data set at
    another rate (another seed) never hits the server's prefix cache from an earlier run.
    """

    path: str
    output_len: int | None = None  # overrides the reply's length
    max_model_len: int = 2048
    min_len: int = 4

    def _pairs(self) -> list[tuple[str, str]]:
        data = json.loads(Path(self.path).read_text(encoding="utf-8"))
        pairs = []
        for item in data:
            turns = item.get("conversations") or item.get("conversation") or []
            if len(turns) >= 2:
                pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
        return pairs

    def requests(self, tokens: TokenSource, n: int, seed: int) -> list[RequestSpec]:
        rng = np.random.default_rng(seed)
        pairs = self._pairs()
        out: list[RequestSpec] = []
        for index in rng.permutation(len(pairs)):
            prompt, reply = pairs[index]
            prompt_ids = tokens.random_ids(rng, 1) + tuple(tokens.encode(prompt))
            output_len = self.output_len or len(tokens.encode(reply))
            if len(prompt_ids) < self.min_len or output_len < self.min_len:
                continue
            if len(prompt_ids) + output_len > self.max_model_len:
                continue
            out.append(RequestSpec(prompt_ids, output_len))
            if len(out) == n:
                return out
        raise ValueError(f"{self.path} has {len(out)} usable conversations, {n} were asked for")


@dataclass(frozen=True)
class Mooncake(Workload):
    """Mooncake trace JSONL: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`.

    Hash id h stands for the same `block_size` tokens wherever it appears in one run, so requests
    sharing leading hash ids share prompt prefixes. The run seed salts the block contents: a replay
    at another rate does not hit the prefix cache filled by an earlier run.
    """

    path: str
    block_size: int = 512
    max_prompt_len: int | None = None  # longer prompts are truncated (leading blocks, and sharing, kept)
    max_output_len: int | None = None

    def records(self, n: int) -> list[dict[str, Any]]:
        """The trace's first `n` requests, as written."""
        records = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    records.append(json.loads(line))
                if len(records) == n:
                    break
        if len(records) < n:
            raise ValueError(f"{self.path} has {len(records)} requests, {n} were asked for")
        return records

    def lengths(self, record: dict[str, Any]) -> tuple[int, int]:
        """(prompt, output) tokens of a record as the load sends it: cut at the workload's limits."""
        prompt, output = int(record["input_length"]), int(record["output_length"])
        if self.max_prompt_len is not None:
            prompt = min(prompt, self.max_prompt_len)
        if self.max_output_len is not None:
            output = min(output, self.max_output_len)
        return prompt, max(1, output)

    def requests(self, tokens: TokenSource, n: int, seed: int) -> list[RequestSpec]:
        blocks: dict[int, tuple[int, ...]] = {}
        out = []
        for index, record in enumerate(self.records(n)):
            length, output_len = self.lengths(record)
            ids: list[int] = []
            for hash_id in record.get("hash_ids") or ():
                if len(ids) >= length:
                    break
                if hash_id not in blocks:
                    blocks[hash_id] = tokens.random_ids(np.random.default_rng([seed, 0, hash_id]), self.block_size)
                ids.extend(blocks[hash_id])
            if len(ids) < length:
                ids.extend(tokens.random_ids(np.random.default_rng([seed, 1, index]), length - len(ids)))
            out.append(RequestSpec(tuple(ids[:length]), output_len))
        return out

    def arrivals(self, n: int) -> Trace:
        stamps = [float(r["timestamp"]) / 1000.0 for r in self.records(n)]
        return Trace(tuple(s - stamps[0] for s in stamps))


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "synthetic": lambda prompt, output: Synthetic(length_dist(prompt), length_dist(output)),
    "sharegpt": ShareGPT,
    "mooncake": Mooncake,
}


def workload(spec: dict[str, Any]) -> Workload:
    spec = dict(spec)
    kind = spec.pop("kind", "synthetic")
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}; known: {sorted(WORKLOADS)}")
    return WORKLOADS[kind](**spec)
