"""The worker link in a live app: once the router has its replicas' stats, prefill and decode calls go
over the link (counted by path), and they give the same answers as Serve's handles (worker_link off),
for streamed and non-streamed, greedy and seeded requests, n > 1 and logprobs included."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")

from pdserve.services.decode.app import build_app as build_decode  # noqa: E402
from pdserve.services.prefill.app import build_app as build_prefill  # noqa: E402
from pdserve.services.router import RouterConfig, build_app  # noqa: E402
from pdserve.services.worker import WorkerConfig  # noqa: E402

APPS = {"link-on": True, "link-off": False}
LONG = "This prompt is long enough for the prefill pool and a KV handoff to decode. " * 2
BODIES = [
    {"prompt": LONG, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    {"prompt": LONG, "max_tokens": 10, "temperature": 0.9, "seed": 7, "n": 2, "logprobs": 2, "ignore_eos": True},
    {"prompt": "short", "max_tokens": 8, "temperature": 0, "ignore_eos": True},  # decode prefills it
]


@pytest.fixture(scope="module")
def urls(ray_serve):
    workers = WorkerConfig(num_blocks=128, num_cpus=0.25)
    for app, link in APPS.items():
        router = RouterConfig(num_cpus=0.25, disaggregate_min_prompt_tokens=16, worker_link=link)
        ray_serve.run(build_app(router, build_prefill(workers), build_decode(workers)), name=app,
                      route_prefix=f"/{app}")
    yield {app: f"http://127.0.0.1:{ray_serve.http_port}/{app}" for app in APPS}
    for app in APPS:
        ray_serve.delete(app)


def _calls(url: str, series: str = "pdserve_router_worker_calls_total") -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(series + "{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["role"].strip('"'), labels["path"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


def _answer(url: str, body: dict, stream: bool) -> list[tuple[int, str, tuple]]:
    body = {"model": "tiny", **body, "stream": stream}
    if not stream:
        choices = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"]
        return sorted((c["index"], c["text"], tuple(c["logprobs"]["tokens"]) if c["logprobs"] else ())
                      for c in choices)
    parts: dict[int, tuple[str, tuple]] = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                import json

                for c in json.loads(line[6:])["choices"]:
                    text, tokens = parts.get(c["index"], ("", ()))
                    parts[c["index"]] = (text + c["text"], tokens + tuple((c["logprobs"] or {}).get("tokens") or ()))
    return sorted((i, text, tokens) for i, (text, tokens) in parts.items())


def test_calls_go_over_the_link_with_the_same_answers_as_serve_handles(urls):
    on, off = urls["link-on"], urls["link-off"]
    deadline = time.monotonic() + 60
    while _calls(on).get(("decode", "link"), 0) == 0:  # the router learns the links from the stats poller
        assert time.monotonic() < deadline, _calls(on)
        _answer(on, BODIES[0], stream=False)
    before = _calls(on)
    for body in BODIES:
        for stream in (False, True):
            assert _answer(on, body, stream) == _answer(off, body, stream), (body, stream)
    after = _calls(on)
    assert after[("prefill", "link")] - before.get(("prefill", "link"), 0) >= 4  # 2 long bodies x 2, n=2 twice
    assert after[("decode", "link")] - before.get(("decode", "link"), 0) >= 8
    assert after.get(("decode", "serve"), 0) == before.get(("decode", "serve"), 0)
    assert all(path == "serve" for _, path in _calls(off))


def test_stats_polls_go_over_the_link_once_known_and_through_serve_without_it(urls):
    """The router's 10 Hz stats (and KV event) polls: the first through the replica actor, whose reply names
    the link, then STATS calls on the link; with the link off, always the actor."""
    on, off = urls["link-on"], urls["link-off"]
    for url in (on, off):
        _answer(url, BODIES[2], stream=False)  # starts the poller
    series = "pdserve_router_stats_polls_total"
    time.sleep(1.0)
    before = _calls(on, series)
    time.sleep(2.0)
    after = _calls(on, series)
    for role in ("prefill", "decode"):
        assert after[(role, "link")] - before.get((role, "link"), 0) >= 3, (before, after)
        assert after.get((role, "serve"), 0) == before.get((role, "serve"), 0) > 0, (before, after)
    polls = _calls(off, series)
    assert {path for _, path in polls} == {"serve"} and polls[("decode", "serve")] >= 3, polls
