"""Standard OpenAI inputs through the official `openai` client, against a live router + prefill + decode
app (redis KV transport, the `tiny` model): prompt batches, logit_bias, echo, continuous usage stats,
cached_tokens, `user`, refused fields, the OpenAPI document; and no KV left behind by bad requests."""

from __future__ import annotations

import time
import uuid

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

KEY = "sk-inputs-test"
APP = "pdserve-inputs"
LONG = "The disaggregated prefill pool handles this long prompt: " * 2  # >= 32 tokens: prefill replica
SHORT = "Hi there"  # decode prefills locally
GREEDY = {"temperature": 0.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(ray_serve, redis_server):
    workers = WorkerConfig(transport="redis", redis_url=redis_server.url, num_blocks=64, num_cpus=1)
    router = RouterConfig(api_keys=(KEY,), num_cpus=0.5, max_choices_per_request=8)
    ray_serve.run(build_app(router, build_prefill(workers), build_decode(workers)), name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{ray_serve.http_port}"
    ray_serve.delete(APP)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm():
    from pdserve.engine import LLM

    return LLM(WorkerConfig().engine_config())  # the engine as the replicas build it (its float16 KV cache too)


def _bad(call, param: str, **kwargs) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call(**kwargs)
    err = info.value
    assert err.status_code == 400 and err.param == param, err.body
    assert err.type == "invalid_request_error" and param in err.message
    return err


KEYS = ("num_free_blocks", "num_total_blocks", "num_leased_blocks", "num_running", "num_waiting")


def _stats(ray_serve) -> dict[str, dict]:
    return {name: {k: s[k] for k in KEYS} for name in ("prefill", "decode")
            for s in [ray_serve.get_deployment_handle(name, app_name=APP).stats.remote().result()]}


def _kv_idle(ray_serve) -> bool:
    return all(s["num_free_blocks"] == s["num_total_blocks"] and not (s["num_leased_blocks"] or s["num_running"]
               or s["num_waiting"]) for s in _stats(ray_serve).values())


def _wait_kv_idle(ray_serve) -> None:
    deadline = time.monotonic() + 15
    while not _kv_idle(ray_serve):
        assert time.monotonic() < deadline, f"KV blocks or sequences still held: {_stats(ray_serve)}"
        time.sleep(0.1)


def test_prompt_batches_are_prompt_major_with_summed_usage(client, llm):
    prompts = [SHORT, LONG]
    alone = [client.completions.create(model="tiny", prompt=p, **GREEDY) for p in prompts]
    resp = client.completions.create(model="tiny", prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert resp.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert resp.usage.completion_tokens == 4 * 6
    ids = [llm.tokenizer.encode(p) for p in prompts]
    by_ids = client.completions.create(model="tiny", prompt=ids, **GREEDY)
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone]

    text: dict[int, str] = {}
    finish = {}
    chunks = list(client.completions.create(model="tiny", prompt=prompts, n=2, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    for c in chunks[:-1]:
        (choice,) = c.choices
        text[choice.index] = text.get(choice.index, "") + choice.text
        finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert text == {c.index: c.text for c in resp.choices} and set(finish.values()) == {"length"}
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 24


def test_prompt_batch_bounds_and_bad_items_are_400(client):
    create = client.completions.create
    _bad(create, "prompt", model="tiny", prompt=["a", "b", "c"], n=3, max_tokens=1)  # 9 > 8 choices
    _bad(create, "prompt", model="tiny", prompt=["a", ""], max_tokens=1)
    _bad(create, "prompt", model="tiny", prompt=[[1, 2], [3, 10**6]], max_tokens=1)
    _bad(create, "prompt", model="tiny", prompt=[[1], []], max_tokens=1)
    _bad(create, "max_tokens", model="tiny", prompt=["a", "word " * 600], max_tokens=1500)


def test_logit_bias_forces_and_bans_tokens_like_the_engine(client, llm):
    forced = llm.tokenizer.encode(" banana", add_special_tokens=False)[-1]
    resp = client.completions.create(model="tiny", prompt=LONG, logit_bias={str(forced): 100}, **GREEDY)
    assert resp.choices[0].text == llm.tokenizer.decode([forced] * 6)  # prefill's first token included
    ids = llm.tokenizer.encode(SHORT)
    plain = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    banned = plain.token_ids[0]
    want = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                              logit_bias={banned: -100.0}))[0]
    assert banned not in want.token_ids
    for call in (client.completions.create, lambda **kw: client.completions.create(stream=True, **kw)):
        got = call(model="tiny", prompt=SHORT, logit_bias={str(banned): -100}, **GREEDY)
        text = got.choices[0].text if hasattr(got, "usage") else "".join(c.choices[0].text for c in got)
        assert text == want.text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          logit_bias={str(forced): 100}, **GREEDY)
    assert chat.choices[0].message.content == llm.tokenizer.decode([forced] * 6)
    _bad(client.completions.create, "logit_bias", model="tiny", prompt="x", logit_bias={"1000000": 1})
    _bad(client.completions.create, "logit_bias", model="tiny", prompt="x", logit_bias={"1": 101})
    _bad(client.completions.create, "logit_bias", model="tiny", prompt="x", logit_bias={"token": 1})


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model="tiny", prompt=[SHORT, LONG], **GREEDY)
    echoed = client.completions.create(model="tiny", prompt=[SHORT, LONG], echo=True, **GREEDY)
    assert [c.text for c in echoed.choices] == [SHORT + plain.choices[0].text, LONG + plain.choices[1].text]
    # cached_tokens depends on what earlier requests left in the prefix cache
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == (
        plain.usage.prompt_tokens, plain.usage.completion_tokens)
    chunks = [c for c in client.completions.create(model="tiny", prompt=SHORT, echo=True, stream=True, **GREEDY)]
    assert chunks[0].choices[0].text.startswith(SHORT)
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    assert echoed.choices[0].logprobs is None  # echo without logprobs: text only


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["decode-only", "prefill-replica"])
def test_echo_with_logprobs_leads_with_the_prompt_logprobs_like_the_engine(client, llm, prompt):
    ids = llm.tokenizer.encode(prompt)
    n = len(ids)
    assert (n >= 32) == (prompt == LONG)
    want = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2,
                                              prompt_logprobs=2))[0]
    want_values = [*want.prompt_logprobs[1:], *want.logprobs]
    want_tops = [{llm.tokenizer.decode([t], skip_special_tokens=False): v for t, v in top}
                 for top in [*want.prompt_top_logprobs[1:], *want.top_logprobs]]
    resp = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=2, **GREEDY)
    (choice,) = resp.choices
    lp = choice.logprobs
    assert choice.text == prompt + want.text and resp.usage.completion_tokens == 6
    tokens = [*ids, *want.token_ids]
    assert lp.tokens == [llm.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    assert lp.text_offset[n] == len(prompt) and lp.text_offset == sorted(lp.text_offset)
    assert lp.token_logprobs[1:] == pytest.approx(want_values, abs=1e-4)
    assert [set(t) for t in lp.top_logprobs[1:]] == [set(t) for t in want_tops]
    for got, expected in zip(lp.top_logprobs[1:], want_tops):
        assert got == pytest.approx(expected, abs=1e-4)

    chunks = list(client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=2, stream=True,
                                            **GREEDY))
    first = chunks[0].choices[0]
    assert first.text.startswith(prompt) and first.logprobs.tokens[:n] == lp.tokens[:n]
    assert first.logprobs.token_logprobs[0] is None and first.logprobs.top_logprobs[0] is None
    streamed = [v for c in chunks for v in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    assert first.logprobs.text_offset == lp.text_offset[: n + 1]  # later ones follow the text streamed so far


def test_continuous_usage_stats_on_every_chunk(client):
    chunks = list(client.completions.create(
        model="tiny", prompt=SHORT, stream=True, **GREEDY,
        stream_options={"include_usage": True, "continuous_usage_stats": True, "include_obfuscation": False}))
    content, last = chunks[:-1], chunks[-1]
    assert len(content) == 6 and all(c.usage is not None for c in content)
    assert [c.usage.completion_tokens for c in content] == [1, 2, 3, 4, 5, 6]
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in content)
    assert last.choices == [] and last.usage.completion_tokens == 6
    only = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               stream=True, stream_options={"continuous_usage_stats": True}, **GREEDY))
    assert all(c.usage is not None and c.choices for c in only)  # no usage-only chunk without include_usage


@pytest.mark.parametrize("disaggregated", [True, False])
def test_cached_tokens_report_prefix_cache_hits(client, disaggregated):
    # a fresh prefix: nothing cached the first time, at least one 16-token block the second time
    prompt = f"{uuid.uuid4().hex[:8]} " + "cache me, please" * (4 if disaggregated else 1)  # ~1 token a byte
    first = client.completions.create(model="tiny", prompt=prompt, **GREEDY)
    assert (first.usage.prompt_tokens >= 32) == disaggregated
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model="tiny", prompt=prompt, **GREEDY)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < second.usage.prompt_tokens and cached % 16 == 0
    chunks = list(client.completions.create(model="tiny", prompt=prompt, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_user_is_accepted(client):
    assert client.completions.create(model="tiny", prompt=SHORT, user="user-42", **GREEDY).choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], user="u", **GREEDY)
    assert chat.choices[0].message.content is not None


def test_chat_text_parts_and_an_absent_model_as_guidellm_sends_them(server, client):
    import httpx

    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    as_parts = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], **GREEDY)
    as_text = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi there"}], **GREEDY)
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    body = {"messages": [{"role": "user", "content": parts}], "stream": True, "stop": None, "ignore_eos": True,
            "max_completion_tokens": 4, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as response:
        lines = [line for line in response.iter_lines() if line]
    assert response.status_code == 200 and lines[-1] == "data: [DONE]"
    assert '"model":"tiny"' in lines[0]
    err = _bad(lambda **kw: client.chat.completions.create(**kw), "messages.0.content", model="tiny",
               messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert "only text parts" in err.message


def test_unsupported_fields_are_refused_by_name(client):
    c, chat = client.completions.create, client.chat.completions.create
    messages = [{"role": "user", "content": "x"}]
    for call, param, kwargs in [
        (c, "suffix", {"prompt": "x", "suffix": "tail"}),
        (c, "best_of", {"prompt": "x", "best_of": 3}),
        (c, "best_of", {"prompt": "x", "n": 2, "best_of": 4}),
    ]:
        err = _bad(call, param, model="tiny", max_tokens=1, **kwargs)
        assert "not supported" in err.message and err.code == "unsupported_parameter"
    err = _bad(chat, "tool_choice", model="tiny", max_tokens=1, messages=messages, tool_choice="required")
    assert "needs tools" in err.message  # tools themselves are supported (tests/integration/test_tool_calling.py)
    assert c(model="tiny", prompt="x", best_of=2, n=2, max_tokens=1).choices[1].index == 1
    assert chat(model="tiny", messages=messages, response_format={"type": "text"}, max_tokens=1).choices


def test_openapi_and_docs_through_the_serve_proxy(server):
    doc = httpx.get(f"{server}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model, field in (("/v1/completions", "CompletionRequest", "prompt"),
                               ("/v1/chat/completions", "ChatCompletionRequest", "messages")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
        assert field in schemas[model]["properties"] and "logit_bias" in schemas[model]["properties"]
        assert field in schemas[model]["required"] and schemas[model]["additionalProperties"] is False
        assert "400" in doc["paths"][path]["post"]["responses"]
    assert "ChatMessage" in schemas and "StreamOptions" in schemas
    docs = httpx.get(f"{server}/docs")
    assert docs.status_code == 200 and "openapi.json" in docs.text


def test_nothing_leaks_after_bad_and_abandoned_requests(server, client, ray_serve):
    _wait_kv_idle(ray_serve)
    for kwargs in ({"prompt": ["a", "b"], "logit_bias": {"-5": 1}}, {"prompt": ["a"] * 9},
                   {"prompt": "x", "suffix": "y"}, {"prompt": [SHORT, [1, 10**7]]}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", max_tokens=4, **kwargs)
    assert _kv_idle(ray_serve)
    body = {"model": "tiny", "prompt": [SHORT, LONG], "n": 2, "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{server}/v1/completions", json=body,
                                                       headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_raw()
        received = b""
        while received.count(b"\n\n") < 8:
            received += next(chunks)
        assert not _kv_idle(ray_serve)
        resp.close()
    _wait_kv_idle(ray_serve)
    text = httpx.get(f"{server}/metrics").text
    assert "pdserve_router_inflight_requests 0.0" in text
