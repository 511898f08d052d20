"""The router's /dashboard in a real browser (Debian's headless Chromium, driven over the DevTools protocol
on a pipe) against `make serve` as users run it (no flags, port 8000, the default model).

Under a load of streaming chat requests (the official openai client), the tiles read from the page's DOM
match the router's own /metrics read at the same moment: SLO attainment, live replicas, queue depth, KV
usage, request and handoff counts, and latency percentiles inside the histogram bucket that holds them.
A decode replica killed with kill -9 turns the decode health tile to breach on the open page, and Serve's
replacement turns it back to OK. PDSERVE_DASHBOARD_SCREENSHOT=path also writes the page under load there
(docs/img/dashboard.png is made so).
"""

from __future__ import annotations

import base64
import fcntl
import importlib.util
import json
import math
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

CHROMIUM = "/usr/bin/chromium"
SIZE = (1280, 900)
pytestmark = pytest.mark.skipif(not Path(CHROMIUM).is_file(), reason=f"needs Debian's chromium at {CHROMIUM}")


def _make_serve_module():
    """test_make_serve.py beside this file (pytest's importlib mode puts no test folder on sys.path)."""
    name = "pdserve_tests_make_serve"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("test_make_serve.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


ms = _make_serve_module()
URL = f"http://127.0.0.1:{ms.PORT}"
# the page's state; before its body exists (still loading), no answer yet
TILES_JS = """JSON.stringify(!document.body ? {polls: 0, window: 0, stale: false, tiles: {}} : {
  polls: +(document.body.dataset.polls || 0), window: +(document.body.dataset.window || 0),
  stale: document.body.classList.contains("stale"),
  tiles: Object.fromEntries([...document.querySelectorAll("[data-tile]")].map((e) => [e.dataset.tile, {
    value: e.dataset.value === "" ? null : +e.dataset.value, status: e.dataset.status,
    count: e.dataset.count === "" ? null : +e.dataset.count}]))})"""


def _above_4(fd: int) -> int:
    """The fd moved past 4, so that bash's `3<&A 4>&B` cannot overwrite one with the other (dash refuses
fds above 9)."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class Browser:
    """Chromium with --remote-debugging-pipe: DevTools commands on fd 3, NUL-terminated JSON answers on fd 4."""

    def __init__(self, url: str) -> None:
        cmd_r, self._cmd = (_above_4(fd) for fd in os.pipe())
        self._out, out_w = (_above_4(fd) for fd in os.pipe())
        self.profile = tempfile.mkdtemp(prefix="pdserve-chromium-")
        args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--remote-debugging-pipe",
                f"--user-data-dir={self.profile}", f"--window-size={SIZE[0]},{SIZE[1]}", url]
        self.proc = subprocess.Popen(["bash", "-c", f'exec "$@" 3<&{cmd_r} 4>&{out_w}', "bash", *args],
                                     pass_fds=(cmd_r, out_w), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(out_w)
        self._buf, self._id = b"", 0
        page = next(t for t in self.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        self.session = self.call("Target.attachToTarget", targetId=page["targetId"], flatten=True)["sessionId"]
        self.call("Emulation.setDeviceMetricsOverride", width=SIZE[0], height=SIZE[1], deviceScaleFactor=1,
                  mobile=False, session=self.session)

    def call(self, method: str, session: str | None = None, timeout: float = 30, **params) -> dict:
        self._id += 1
        os.write(self._cmd, json.dumps({"id": self._id, "method": method, "params": params,
                                        **({"sessionId": session} if session else {})}).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                ready, _, _ = select.select([self._out], [], [], max(0.0, deadline - time.monotonic()))
                assert ready, f"chromium did not answer {method} within {timeout}s"
                chunk = os.read(self._out, 1 << 20)
                assert chunk, "chromium closed its DevTools pipe"
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._id:
                assert "error" not in reply, reply["error"]
                return reply["result"]

    def page(self) -> dict:
        found = self.call("Runtime.evaluate", self.session, expression=TILES_JS, returnByValue=True)
        assert "exceptionDetails" not in found, found["exceptionDetails"]
        return json.loads(found["result"]["value"])

    def wait(self, what: str, until, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not until(state := self.page()):
            assert time.monotonic() < deadline, f"the page never showed {what} within {timeout}s: {state}"
            time.sleep(0.25)
        return state

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", self.session, format="png")["data"])

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`make serve` as users run it, for the whole module; one Ctrl-C stops it and leaves nothing behind."""
    if ms._port_taken(ms.PORT):
        pytest.fail(f"port {ms.PORT} is taken by another program: `make serve` listens there", pytrace=False)
    run = ms.MakeServe(tmp_path_factory.mktemp("make-serve") / "make-serve.log")
    try:
        run.wait_for("pdserve is serving", timeout=600)
        yield run
        run.ctrl_c()
        run.assert_nothing_left()
    finally:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()


@pytest.fixture
def browser(served):
    opened = Browser(f"{URL}/dashboard")
    yield opened
    opened.close()


def status(page: dict, key: str) -> str | None:
    """A tile's status; None while the page has no answer yet."""
    return page["tiles"].get(key, {}).get("status")


def scrape() -> dict[str, list]:
    text = httpx.get(f"{URL}/metrics", timeout=30).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def samples(metrics: dict, family: str, sample: str | None = None, **labels: str) -> list:
    return [s for s in metrics.get(family, ()) if (sample is None or s.name == sample)
            and all(s.labels.get(k) == v for k, v in labels.items())]


def total(metrics: dict, family: str, sample: str, **labels: str) -> float:
    return sum(s.value for s in samples(metrics, family, sample, **labels))


def window_buckets(before: dict, after: dict, family: str) -> list[tuple[float, float]]:
    """(le, count) of the router's histogram between two scrapes."""
    def by_le(metrics: dict) -> dict[float, float]:
        return {float(s.labels["le"]): s.value for s in samples(metrics, family, family + "_bucket", role="router")}
    start = by_le(before)
    return sorted((le, n - start.get(le, 0.0)) for le, n in by_le(after).items())


def bucket_bounds(q: float, cumulative: list[tuple[float, float]]) -> tuple[float, float]:
    """The bounds of the bucket where the q-quantile's rank falls."""
    rank, lower = q * cumulative[-1][1], 0.0
    for le, n in cumulative:
        if n >= rank:
            return (lower, lower) if math.isinf(le) else (lower, le)
        lower = le
    raise AssertionError(cumulative)


def replicas(metrics: dict, role: str) -> set[str]:
    return {s.labels["replica"] for s in samples(metrics, "pdserve_requests_waiting", role=role)}


def chat_load(errors: list, num_threads: int = 3, per_thread: int = 2) -> threading.Thread:
    import openai

    def one_thread(i: int) -> None:
        client = openai.OpenAI(base_url=f"{URL}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            for k in range(per_thread):
                stream = client.chat.completions.create(
                    model=ms.MODEL, messages=[{"role": "user", "content": f"Describe city number {i * 10 + k}."}],
                    max_tokens=32, temperature=0, stream=True)
                chunks = list(stream)  # to the end: a stream left early ends as a disconnect, when it is noticed
                assert any(c.choices and c.choices[0].delta.content for c in chunks)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    def run() -> None:
        threads = [threading.Thread(target=one_thread, args=(i,)) for i in range(num_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    load = threading.Thread(target=run, daemon=True)
    load.start()
    return load


def test_tiles_under_load_match_the_routers_metrics(browser):
    browser.wait("a window", lambda p: p["polls"] >= 2 and p["window"] > 0, timeout=30)  # its base reading is kept
    before, started = scrape(), time.monotonic()
    errors: list = []
    load = chat_load(errors)
    during = browser.wait("traffic", lambda p: (p["tiles"].get("ttft_p50", {}).get("count") or 0) >= 3, timeout=120)
    assert not during["stale"] and during["tiles"]["request_rate"]["status"] == "info"
    shot = browser.screenshot()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", shot[16:24]) == SIZE
    if target := os.environ.get("PDSERVE_DASHBOARD_SCREENSHOT"):
        Path(target).write_bytes(shot)
    load.join(180)
    assert not load.is_alive() and not errors, errors
    # the router records a request once its stream has ended: wait for all six, then the page's next polls
    deadline, after = time.monotonic() + 30, scrape()
    while window_buckets(before, after, "pdserve_e2e_request_latency_seconds")[-1][1] < 6:
        assert time.monotonic() < deadline, "the router never recorded every request's end"
        time.sleep(0.5)
        after = scrape()
    polls = browser.page()["polls"]
    page = browser.wait("two answers after the scrape", lambda p: p["polls"] >= polls + 2, timeout=15)
    again = scrape()
    tiles = page["tiles"]
    # the page's base reading (kept before `before`) stays the window's start for slo_window_s (60 s)
    assert time.monotonic() - started < 50, "the load outlasted the window: its counts would differ from /metrics"

    both = [s.value for s in samples(after, "pdserve_slo_attainment", slo="both", role="router")]
    assert [tiles["slo_attainment"]["value"]] == both == [s.value for s in samples(
        again, "pdserve_slo_attainment", slo="both", role="router")]
    assert tiles["slo_attainment"]["status"] == ("ok" if both[0] >= 0.9 else "breach")
    for role in ("prefill", "decode"):
        assert tiles[f"health:{role}"]["value"] == len(replicas(after, role)) == 1
        assert tiles[f"health:{role}"]["status"] == "ok"
        if live := samples(after, "pdserve_router_live_replicas", role=role):
            assert tiles[f"health:{role}"]["value"] == live[0].value
        usage = max(s.value for s in samples(after, "pdserve_kv_cache_usage_ratio", role=role))
        assert tiles[f"kv_usage:{role}"]["value"] == pytest.approx(usage, abs=0.02)
        waiting = total(after, "pdserve_requests_waiting", "pdserve_requests_waiting", role=role)
        assert tiles[f"queue_depth:{role}"]["value"] == waiting

    requests = total(after, "pdserve_router_requests", "pdserve_router_requests_total", endpoint="chat") - total(
        before, "pdserve_router_requests", "pdserve_router_requests_total", endpoint="chat")
    assert requests == 6 and tiles["request_rate"]["count"] == requests
    assert tiles["error_rate"]["value"] == 0 and tiles["error_rate"]["status"] == "ok"
    tokens = [total(m, "pdserve_generation_tokens", "pdserve_generation_tokens_total", role="router")
              for m in (before, after)]
    assert tiles["output_tokens_per_s"]["count"] == tokens[1] - tokens[0] > 0
    disaggregated = [total(m, "pdserve_disaggregation_decisions", "pdserve_disaggregation_decisions_total",
                           decision="disaggregate") for m in (before, after)]
    assert tiles["fallback_rate"]["count"] == disaggregated[1] - disaggregated[0]
    for key, family, q in (("ttft_p50", "pdserve_time_to_first_token_seconds", 0.5),
                           ("ttft_p95", "pdserve_time_to_first_token_seconds", 0.95),
                           ("tpot_p50", "pdserve_time_per_output_token_seconds", 0.5),
                           ("e2e_p50", "pdserve_e2e_request_latency_seconds", 0.5),
                           ("e2e_p95", "pdserve_e2e_request_latency_seconds", 0.95)):
        cumulative = window_buckets(before, after, family)
        assert tiles[key]["count"] == cumulative[-1][1] > 0, key  # TPOT: the requests with two tokens or more
        assert key.startswith("tpot") or cumulative[-1][1] == 6, key
        lower, upper = bucket_bounds(q, cumulative)
        assert lower - 1e-9 <= tiles[key]["value"] <= upper + 1e-9, (key, tiles[key], cumulative)
    assert tiles["ttft_p95"]["status"] == ("ok" if tiles["ttft_p95"]["value"] <= 2.0 else "breach")


def test_a_killed_decode_replica_turns_its_health_tile_to_breach_then_back_to_ok(browser, replica_pids):
    browser.wait("decode healthy", lambda p: status(p, "health:decode") == "ok", timeout=30)
    [victim] = replica_pids("pdserve", "decode")
    os.kill(victim, signal.SIGKILL)
    down = browser.wait("decode in breach", lambda p: status(p, "health:decode") == "breach", timeout=30)
    assert down["tiles"]["health:decode"]["value"] == 0 and not down["stale"]
    assert down["tiles"]["health:prefill"]["status"] == "ok"
    assert httpx.get(f"{URL}/health", timeout=10).status_code == 503  # the router agrees
    browser.wait("decode back", lambda p: status(p, "health:decode") == "ok", timeout=300)
    assert replica_pids("pdserve", "decode") not in ([], [victim])
    assert httpx.get(f"{URL}/health", timeout=10).status_code == 200
