"""The router over real HTTP on loopback, in front of real prefill and decode Serve replicas.

One app per module: router (API key configured) + prefill + decode, redis KV transport.
"""

from __future__ import annotations

import json
import time

import pytest
from pdserve.sampling_params import SamplingParams
from pdserve.services.worker import WorkerConfig

pytest.importorskip("ray")
openai = pytest.importorskip("openai")
try:
    import httpx
except ImportError:  # the openai client here ships on httpx2
    import httpx2 as httpx

from pdserve.services.decode.app import build_app as build_decode
from pdserve.services.prefill.app import build_app as build_prefill
from pdserve.services.router import RouterConfig, build_app

KEY = "sk-router-test"
APP = "pdserve"
LONG_PROMPT = "The disaggregated prefill pool handles this long prompt: " * 2  # >= 32 tokens
SHORT_PROMPT = "Hi there"  # < 32 tokens: decode prefills locally
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(ray_serve, redis_server):
    workers = WorkerConfig(transport="redis", redis_url=redis_server.url, num_blocks=64, num_cpus=1)
    router = RouterConfig(api_keys=(KEY,), max_body_bytes=64 << 10, num_cpus=0.5)
    ray_serve.run(build_app(router, build_prefill(workers), build_decode(workers)), name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{ray_serve.http_port}"
    ray_serve.delete(APP)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm():
    from pdserve.engine import LLM

    return LLM(model="tiny", device="cpu", dtype="float32")


def _expected(llm, prompt, max_tokens=12):
    ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    out = llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    return ids, out


def _chat_ids(llm, messages):
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)


def _metric(server, name, **labels):
    """The sum of the samples called `name` whose labels include `labels` (every role and replica)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server}/metrics").text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


@pytest.mark.parametrize("prompt,reason", [(LONG_PROMPT, "long_prompt"), (SHORT_PROMPT, "short_prompt")])
def test_completion_greedy_equals_engine(server, client, llm, prompt, reason):
    ids, expected = _expected(llm, prompt)
    decision = "disaggregate" if reason == "long_prompt" else "skip"
    before = _metric(server, "pdserve_disaggregation_decisions_total", decision=decision, reason=reason)
    resp = client.completions.create(model="tiny", prompt=prompt, **GREEDY)
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == len(ids) + 12
    assert _metric(server, "pdserve_disaggregation_decisions_total", decision=decision, reason=reason) == before + 1

    chunks = list(client.completions.create(model="tiny", prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(ids)
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"


@pytest.mark.parametrize("content", ["Say hi", "Tell me everything about disaggregated serving, prefill and decode."])
def test_chat_greedy_equals_engine(client, llm, content):
    messages = [{"role": "user", "content": content}]
    ids = _chat_ids(llm, messages)
    _, expected = _expected(llm, ids)
    resp = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 12

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_sse_framing(server):
    body = {"model": "tiny", "prompt": SHORT_PROMPT, "max_tokens": 3, "stream": True, "ignore_eos": True}
    resp = httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = resp.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event[6:])["object"] == "text_completion"


def test_n_with_seed_is_reproducible(client):
    kwargs = {"model": "tiny", "prompt": SHORT_PROMPT, "max_tokens": 8, "n": 3, "seed": 7, "temperature": 1.0}
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # seeds seed+i differ
    streamed = list(client.completions.create(stream=True, **kwargs))
    by_index = {}
    for c in streamed:
        by_index[c.choices[0].index] = by_index.get(c.choices[0].index, "") + c.choices[0].text
    assert [by_index[i] for i in range(3)] == [c.text for c in first.choices]


def test_logprobs(client):
    resp = client.completions.create(model="tiny", prompt=SHORT_PROMPT, logprobs=2, **GREEDY)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert all(x <= 0 for x in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                          logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12 and all(len(c.top_logprobs) == 3 for c in content)


def test_logprobs_when_disaggregated_match_the_colocated_path(server, client, colocated):
    before = _metric(server, "pdserve_disaggregation_decisions_total", decision="disaggregate", reason="long_prompt")
    disagg = client.completions.create(model="tiny", prompt=LONG_PROMPT, logprobs=2, **GREEDY).choices[0].logprobs
    assert _metric(server, "pdserve_disaggregation_decisions_total", decision="disaggregate", reason="long_prompt") == before + 1
    local = colocated.completions.create(model="tiny", prompt=LONG_PROMPT, logprobs=2, **GREEDY).choices[0].logprobs
    assert disagg.tokens == local.tokens and len(disagg.token_logprobs) == 12
    assert disagg.token_logprobs == pytest.approx(local.token_logprobs, abs=1e-4)
    assert [sorted(t) for t in disagg.top_logprobs] == [sorted(t) for t in local.top_logprobs]


def test_stop_string(client, llm):
    _, expected = _expected(llm, SHORT_PROMPT)
    stop = expected.text[4:6]
    resp = client.completions.create(model="tiny", prompt=SHORT_PROMPT, stop=[stop], **GREEDY)
    assert resp.choices[0].text == expected.text[: expected.text.find(stop)]
    assert resp.choices[0].finish_reason == "stop"


def _post(server, path, body=None, *, content=None, headers=None, key=KEY):
    hdrs = {"Authorization": f"Bearer {key}"} if key else {}
    hdrs.update(headers or {})
    if content is None:
        return httpx.post(f"{server}{path}", json=body, headers=hdrs)
    return httpx.post(f"{server}{path}", content=content, headers=hdrs)


def _assert_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize("body,param", [
    ({"model": "", "prompt": "x"}, "model"),  # absent means the served model; empty is an error
    ({"model": "tiny"}, "prompt"),
    ({"model": "tiny", "prompt": ""}, "prompt"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "temperature": 3}, "temperature"),
    ({"model": "tiny", "prompt": "x", "bogus": 1}, "bogus"),
    ({"model": "tiny", "prompt": [1, 2, 100000]}, "prompt"),
])
def test_invalid_requests_are_400(server, body, param):
    error = _assert_error(_post(server, "/v1/completions", body), 400, param)
    assert error["type"] == "invalid_request_error"


def test_transport_level_errors(server):
    _assert_error(_post(server, "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    _assert_error(_post(server, "/v1/completions", content=b'{"model":"tiny"}', headers={"Content-Type": "text/plain"}), 400)
    big = json.dumps({"model": "tiny", "prompt": "x" * (70 << 10)}).encode()
    _assert_error(_post(server, "/v1/completions", content=big, headers={"Content-Type": "application/json"}), 413)
    error = _assert_error(_post(server, "/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404)
    assert error["code"] == "model_not_found"
    error = _assert_error(_post(server, "/v1/completions", {"model": "tiny", "prompt": "abc", "max_tokens": 2048}), 400)
    assert "2048" in error["message"] and "4 tokens" in error["message"]


def test_api_key_required_but_health_and_metrics_open(server, client):
    _assert_error(_post(server, "/v1/completions", {"model": "tiny", "prompt": "x"}, key=None), 401)
    _assert_error(_post(server, "/v1/completions", {"model": "tiny", "prompt": "x"}, key="sk-wrong"), 401)
    assert httpx.get(f"{server}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/metrics").status_code == 200
    assert _metric(server, "pdserve_rejections_total", reason="unauthorized") >= 2


def test_models_health_metrics_and_request_id(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    resp = httpx.get(f"{server}/health", headers={"X-Request-Id": "abc-123"})
    assert resp.status_code == 200 and resp.headers["x-request-id"] == "abc-123"
    resp = _post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1},
                 headers={"X-Request-Id": "req-42"})
    assert resp.headers["x-request-id"] == "req-42" and resp.json()["id"] == "cmpl-req-42"
    assert len(_post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1}).headers["x-request-id"]) >= 16
    assert _post(server, "/v1/completions", {"prompt": "x"}, headers={"X-Request-Id": "bad-1"}).headers["x-request-id"] == "bad-1"
    text = httpx.get(f"{server}/metrics").text
    for name in ("pdserve_router_requests_total", "pdserve_time_to_first_token_seconds_bucket",
                 "pdserve_e2e_request_latency_seconds_bucket", "pdserve_generation_tokens_total"):
        assert name in text


def _all_blocks_free(ray_serve):
    for name in ("prefill", "decode"):
        stats = ray_serve.get_deployment_handle(name, app_name=APP).stats.remote().result()
        if stats["num_free_blocks"] != stats["num_total_blocks"] or stats["num_leased_blocks"]:
            return False
    return True


@pytest.mark.parametrize("prompt,num_events", [(LONG_PROMPT, 3), (SHORT_PROMPT, 3), (LONG_PROMPT, 1)])
def test_disconnect_mid_stream_frees_kv(server, ray_serve, prompt, num_events):
    """num_events=1 on a long prompt: the client leaves right after prefill's first token, while decode
    may still be pulling the KV; the prefill lease must be freed as well as decode's blocks."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{server}/v1/completions", json=body,
                     headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_raw()  # keep a reference: dropping the iterator closes the response
        received = b""
        while received.count(b"\n\n") < num_events:
            received += next(chunks)
        if num_events > 1:
            assert not _all_blocks_free(ray_serve)  # the request is running and holds KV
        resp.close()
    deadline = time.monotonic() + 10
    while not _all_blocks_free(ray_serve):
        assert time.monotonic() < deadline, "KV blocks still allocated after the client went away"
        time.sleep(0.1)



@pytest.fixture(scope="module")
def colocated(ray_serve, server):
    decode = build_decode(WorkerConfig(num_blocks=64, num_cpus=0.5))
    router = RouterConfig(mode="colocated", num_cpus=0)
    ray_serve.run(build_app(router, None, decode), name="pdserve-colocated", route_prefix="/colocated")
    yield openai.OpenAI(base_url=f"{server}/colocated/v1", api_key="unused", max_retries=0, timeout=60)
    ray_serve.delete("pdserve-colocated")


def test_colocated_mode_returns_the_same_tokens(colocated, client, llm):
    _, expected = _expected(llm, LONG_PROMPT)
    resp = colocated.completions.create(model="tiny", prompt=LONG_PROMPT, **GREEDY)
    assert resp.choices[0].text == expected.text
    disaggregated = client.completions.create(model="tiny", prompt=LONG_PROMPT, **GREEDY)
    assert disaggregated.choices[0].text == resp.choices[0].text
    chunks = list(colocated.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    stream=True, **GREEDY))
    assert chunks[-1].choices[0].finish_reason == "length"
