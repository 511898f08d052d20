"""A decode replica killed (`kill -9`) mid-stream: every stream on it moves to the other decode replica
and goes on with no token missing or repeated. Seeded sampled requests are checked token for token
against the engine run offline and a no-fault run of the same requests (placement, split or whole, never
changes a seeded stream); /health answers within its bound throughout."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from pdserve.engine import LLM  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.services.decode.app import build_app as build_decode  # noqa: E402
from pdserve.services.prefill.app import build_app as build_prefill  # noqa: E402
from pdserve.services.router import RouterConfig, build_app  # noqa: E402
from pdserve.services.worker import WorkerConfig  # noqa: E402

APP = "fault-decode"
PROMPT = "A decode replica dies in the middle of this stream, and the stream must not notice. " * 3
NUM_REQUESTS = 6
MAX_TOKENS = 64
HEALTH_BOUND_S = 1.5  # the router answers /health within 1 s; the rest is this client's slack


@pytest.fixture(scope="module")
def url(ray_serve):
    prefill = WorkerConfig(num_blocks=256, num_cpus=0.25)
    decode = WorkerConfig(num_blocks=256, num_cpus=0.25, num_replicas=2)
    router = RouterConfig(num_cpus=0.25, disaggregate_min_prompt_tokens=16, placement={"policy": "round_robin"})
    ray_serve.run(build_app(router, build_prefill(prefill), build_decode(decode)), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_serve.http_port}/{APP}"
    ray_serve.delete(APP)


def _body(i: int) -> dict:
    return {"model": "tiny", "prompt": f"{i}. {PROMPT}", "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "seed": 1000 + i, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def _stream(client: httpx.AsyncClient, url: str, i: int, progress: list[int], body=_body) -> list[dict]:
    raw = b""
    async with client.stream("POST", f"{url}/v1/completions", json=body(i)) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for part in resp.aiter_bytes():
            raw += part
            progress[i] += part.count(b'"text"')
    events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _outcome(events: list[dict]) -> tuple[str, list, int]:
    assert not [e for e in events if "error" in e], events
    text = "".join(c["text"] for e in events for c in e["choices"])
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    return text, finish, events[-1]["usage"]["completion_tokens"]


def _counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _health(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=HEALTH_BOUND_S).status_code  # a slower answer raises


def test_streams_on_a_killed_decode_replica_move_and_continue_exactly(url, replica_pids):
    async def run(kill: bool) -> list[list[dict]]:
        progress = [0] * NUM_REQUESTS
        async with httpx.AsyncClient(timeout=180) as client:
            tasks = [asyncio.create_task(_stream(client, url, i, progress)) for i in range(NUM_REQUESTS)]
            if kill:
                while min(progress) < 4 and not all(t.done() for t in tasks):  # every stream is decoding
                    await asyncio.sleep(0.005)
                victim = replica_pids(APP, "decode")[0]
                os.kill(victim, signal.SIGKILL)
                started = time.monotonic()
                statuses = []
                while not all(t.done() for t in tasks) and time.monotonic() - started < 10:
                    statuses.append(await asyncio.to_thread(_health, url))
                    await asyncio.sleep(0.2)
                assert set(statuses) <= {200, 503}
            return await asyncio.gather(*tasks)

    offline = LLM(model="tiny").generate(
        [f"{i}. {PROMPT}" for i in range(NUM_REQUESTS)],
        [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1000 + i, ignore_eos=True) for i in range(NUM_REQUESTS)])
    baseline = [_outcome(events) for events in asyncio.run(run(kill=False))]
    assert all(finish == ["length"] and n == MAX_TOKENS for _, finish, n in baseline)
    assert [text for text, _, _ in baseline] == [c.text for c in offline]
    before = _counter(url, "pdserve_migrations_total")
    migrated = [_outcome(events) for events in asyncio.run(run(kill=True))]
    assert migrated == baseline  # same text, one finish, every token counted once
    assert _counter(url, "pdserve_migrations_total") - before >= 1
    deadline = time.monotonic() + 120
    while len(replica_pids(APP, "decode")) < 2:
        assert time.monotonic() < deadline, "Serve did not restart the decode replica"
        time.sleep(1)


GUIDED_SCHEMA = {"type": "object", "properties": {
    "steps": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 12, "maxItems": 12},
    "done": {"type": "boolean"}}, "required": ["steps", "done"], "additionalProperties": False}
GUIDED_MAX_TOKENS = 200  # above the longest value the schema allows, in the tiny model's byte tokens


def _guided_body(i: int) -> dict:
    return {"model": "tiny", "prompt": f"{i}. {PROMPT}", "max_tokens": GUIDED_MAX_TOKENS, "temperature": 1.0,
            "seed": 2000 + i, "stream": True, "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema", "json_schema": {"name": "steps", "schema": GUIDED_SCHEMA}}}


def test_guided_streams_on_a_killed_decode_replica_migrate_and_still_validate(url, replica_pids):
    """response_format json_schema, sampled and seeded: the new decode replica rebuilds the grammar state from
    the tokens already sent, so the migrated output is the no-fault output, and it validates."""
    jsonschema = pytest.importorskip("jsonschema")
    deadline = time.monotonic() + 120
    while len(replica_pids(APP, "decode")) < 2:  # the test above killed one
        assert time.monotonic() < deadline, "Serve did not restart the decode replica"
        time.sleep(1)

    async def run(kill: bool) -> list[list[dict]]:
        progress = [0] * NUM_REQUESTS
        async with httpx.AsyncClient(timeout=180) as client:
            tasks = [asyncio.create_task(_stream(client, url, i, progress, _guided_body))
                     for i in range(NUM_REQUESTS)]
            if kill:
                while min(progress) < 8 and not all(t.done() for t in tasks):  # every stream is decoding
                    await asyncio.sleep(0.005)
                os.kill(replica_pids(APP, "decode")[0], signal.SIGKILL)
            return await asyncio.gather(*tasks)

    baseline = [_outcome(events) for events in asyncio.run(run(kill=False))]
    for text, finish, _ in baseline:
        assert finish == ["stop"]
        jsonschema.validate(json.loads(text), GUIDED_SCHEMA)
    before = _counter(url, "pdserve_migrations_total")
    migrated = [_outcome(events) for events in asyncio.run(run(kill=True))]
    assert migrated == baseline  # the grammar state resumed: same text, one finish, every token counted once
    assert _counter(url, "pdserve_migrations_total") - before >= 1
