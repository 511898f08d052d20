"""The streaming client and the run loop against an in-process fake server (httpx MockTransport)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pdserve.loadtest import runner
from pdserve.loadtest.client import RequestResult, completion_body, send
from pdserve.loadtest.distributions import Fixed
from pdserve.loadtest.runner import LoadConfig, run_load, run_point, run_seed
from pdserve.loadtest.workloads import RequestSpec, Synthetic, TokenSource

TOKENS = TokenSource(tuple(range(256)), lambda text: list(text.encode()))
SPEC = RequestSpec((1, 2, 3), 3)


def sse(*objects) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objects) + b"data: [DONE]\n\n"


def choice(text: str) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}


def client_for(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://127.0.0.1")


def one(handler) -> RequestResult:
    async def go():
        async with client_for(handler) as client:
            return await send(client, "http://127.0.0.1", "m", SPEC, RequestResult(0, 3, 3, 0.0), 0.0)
    return asyncio.run(go())


def test_request_body_pins_lengths_and_streams_usage():
    body = completion_body("m", SPEC)
    assert body["prompt"] == [1, 2, 3]
    assert body["max_tokens"] == body["min_tokens"] == 3 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_stream_parsing_counts_chunks_and_usage_tokens():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        assert request.url.path == "/v1/completions"
        return httpx.Response(200, content=sse(choice("a"), choice(""), choice("bc"), USAGE))

    r = one(handler)
    assert r.status == "ok" and r.http_status == 200
    assert len(r.chunk_times) == 3  # an empty-text chunk still carries a token
    assert r.output_tokens == 3 and r.e2e_s >= r.chunk_times[-1] >= r.chunk_times[0] >= 0
    assert seen["model"] == "m"


@pytest.mark.parametrize(("code", "status"), [(429, "rejected"), (503, "rejected"), (400, "error"), (500, "error")])
def test_http_failures(code, status):
    r = one(lambda request: httpx.Response(code, json={"error": {"message": "no"}}))
    assert r.status == status and r.http_status == code and str(code) in r.error


def test_error_inside_the_stream_and_empty_stream_are_errors():
    r = one(lambda request: httpx.Response(200, content=sse(choice("a"), {"error": {"message": "boom"}})))
    assert r.status == "error" and "boom" in r.error
    r = one(lambda request: httpx.Response(200, content=sse(USAGE)))
    assert r.status == "error"


def test_connection_failure_is_an_error():
    def handler(request):
        raise httpx.ConnectError("refused")

    assert one(handler).status == "error"


class SlowServer:
    """Answers after `delay` seconds (asyncio sleep), every request a 3-token stream."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(self.delay)
        return httpx.Response(200, content=sse(choice("a"), choice("b"), choice("c"), USAGE))


@pytest.fixture
def fake_server(monkeypatch):
    def install(delay: float) -> None:
        monkeypatch.setattr(runner, "new_client", lambda n: client_for(SlowServer(delay)))
    return install


def test_open_loop_follows_the_schedule(fake_server):
    fake_server(0.0)
    schedule = [0.0, 0.1, 0.2]
    results, duration = asyncio.run(run_load("http://127.0.0.1", "m", [SPEC] * 3, 5.0, schedule=schedule))
    assert all(r.ok for r in results)
    assert [r.scheduled_s for r in results] == schedule
    assert all(r.sent_s >= r.scheduled_s - 1e-3 for r in results)
    assert 0.2 <= duration < 2.0


def test_deadline_cancels_and_counts_unfinished_requests(fake_server):
    fake_server(0.3)
    schedule = [0.0, 0.0, 0.5, 5.0]  # two finish, one is cut mid-request, one is never sent
    results, duration = asyncio.run(run_load("http://127.0.0.1", "m", [SPEC] * 4, 0.6, schedule=schedule))
    assert [r.status for r in results] == ["ok", "ok", "cancelled", "cancelled"]
    assert results[3].sent_s is None and results[2].sent_s is not None
    assert duration == 0.6


def test_closed_loop_keeps_concurrency(fake_server):
    fake_server(0.1)
    results, duration = asyncio.run(run_load("http://127.0.0.1", "m", [SPEC] * 6, 5.0, concurrency=2))
    assert all(r.ok for r in results)
    assert 0.28 <= duration < 1.5  # 3 waves of 2
    with pytest.raises(ValueError):
        asyncio.run(run_load("http://127.0.0.1", "m", [SPEC], 1.0))


def test_run_point_is_seeded_by_rate(fake_server):
    fake_server(0.0)
    work = Synthetic(Fixed(5), Fixed(3))
    load = LoadConfig(num_requests=4, max_duration_s=10, arrival="constant", seed=1)
    run = run_point("http://127.0.0.1", "m", TOKENS, work, load, rate=50.0, progress=False)
    c = run.summary.counts
    assert (c.total, c.completed) == (4, 4)
    assert run.seed == run_seed(1, 50.0) != run_seed(1, 25.0)
    assert [r.scheduled_s for r in run.results] == pytest.approx([0.0, 0.02, 0.04, 0.06])
    with pytest.raises(ValueError):
        LoadConfig(arrival="zipf")
