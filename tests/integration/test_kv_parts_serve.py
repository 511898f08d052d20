"""A prompt's KV handed from prefill to decode in parts while it is prefilled (router kv_part_tokens),
through the real router, prefill and decode deployments: the same greedy text as the engine alone, on the
default same-host path, over UCX and through Redis; parts were pulled before the tail; nothing stays leased or staged."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from pdserve.engine import LLM
from pdserve.sampling_params import SamplingParams
from pdserve.services.decode.app import build_app as build_decode
from pdserve.services.prefill.app import build_app as build_prefill
from pdserve.services.router import RouterConfig, build_app
from pdserve.services.worker import WorkerConfig
from ray import serve

PART_TOKENS = 32
PROMPT = "Parts of this prompt's KV move to decode while the rest of it is still being prefilled. " * 3
MAX_TOKENS = 12
PATHS = {"shm": {}, "ucx": {"kv_same_host": False}, "redis": {"transport": "redis"}}


@pytest.fixture(scope="module")
def apps(ray_serve, redis_server):
    urls = {}
    for name, extra in PATHS.items():
        if name == "redis":
            extra = {**extra, "redis_url": redis_server.url}
        workers = WorkerConfig(num_blocks=128, num_cpus=0.5, **extra)
        router = RouterConfig(num_cpus=0.25, disaggregate_min_prompt_tokens=16, kv_part_tokens=PART_TOKENS)
        app = f"kv-parts-{name}"
        ray_serve.run(build_app(router, build_prefill(workers), build_decode(workers)), name=app,
                      route_prefix=f"/{app}")
        urls[name] = (app, f"http://127.0.0.1:{ray_serve.http_port}/{app}")
        for _ in range(100):  # parts need a named decode replica: placement names one once it has stats
            if httpx.get(f"{urls[name][1]}/health", timeout=5).status_code == 200:
                break
            time.sleep(0.1)
    yield urls
    for app, _ in urls.values():
        ray_serve.delete(app)


def _complete(url: str, prompt: str, stream: bool) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    if not stream:
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["text"]
    import json

    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
    return text


def _settled(app: str) -> tuple[dict, dict]:
    prefill = serve.get_deployment_handle("prefill", app_name=app)
    decode = serve.get_deployment_handle("decode", app_name=app)
    for _ in range(60):  # pulled parts are released once each importer's ack lands
        p, d = prefill.stats.remote().result(), decode.stats.remote().result()
        if p["num_leased_blocks"] == d["num_leased_blocks"] == 0 and p["num_free_blocks"] == p["num_total_blocks"] \
                and d["num_free_blocks"] == d["num_total_blocks"]:
            break
        time.sleep(0.05)
    return p, d


@pytest.mark.parametrize("path", list(PATHS))
def test_parts_give_the_engines_greedy_text_and_leave_nothing_held(apps, path):
    app, url = apps[path]
    llm = LLM(model="tiny", device="cpu", dtype="float32")
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    decode = serve.get_deployment_handle("decode", app_name=app)
    before = decode.kv_transfer_stats.remote().result()["num_parts_staged"]
    for i, stream in enumerate((True, False)):
        prompt = f"{i} {PROMPT}"
        expected = llm.generate([prompt], greedy)[0].text
        assert _complete(url, prompt, stream) == expected
    stats = decode.kv_transfer_stats.remote().result()
    num_prompt_tokens = len(llm.tokenizer.encode(PROMPT))
    assert stats["num_parts_staged"] - before >= 2 * ((num_prompt_tokens // PART_TOKENS) - 1)
    assert stats["num_staged_imports"] == 0
    p, d = _settled(app)
    assert p["num_leased_blocks"] == d["num_leased_blocks"] == 0
    assert p["num_free_blocks"] == p["num_total_blocks"] and d["num_free_blocks"] == d["num_total_blocks"]
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    assert "pdserve_kv_transfer_exposed_seconds_count" in metrics
