"""The chart's Grafana dashboards and alert rules against a real Prometheus scraping a live `pdserve serve`.

Prometheus (Debian's package) scrapes the router's /metrics every second and evaluates the chart's rule
file every second. Under light traffic every PromQL expression in the dashboards and the rules must
return a series (comparisons turned into `bool` ones, so a healthy system's alerts still show their
values); then real faults, a decode replica killed with SIGKILL and the Redis server killed, must take
the matching alert to pending or firing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from pdserve.runtime.ports import listen_port
from pdserve.runtime.redis_server import RedisServer


def _load_beside(module: str):
    """A helper module beside this file (pytest's importlib mode puts no test folder on sys.path)."""
    name = f"pdserve_tests_{module}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{module}.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


PrometheusServer = _load_beside("prometheus_server").PrometheusServer
process_tree = _load_beside("test_make_serve")._descendants  # pid -> start time, below a root and in its session

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "pdserve"
RULES = CHART / "rules" / "pdserve-alerts.yaml"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))

pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(not PrometheusServer.available(), reason="needs Debian's prometheus (make ops-tools)")

_COMPARISON = re.compile(r"(>=|<=|==|!=|>|<)(\s*bool\b)?")
_GRAFANA_VARIABLES = {"$__rate_interval": "1m", "${__rate_interval}": "1m", "$__interval": "15s",
                      "${replica}": ".+", "$replica": ".+", "${role}": ".+", "$role": ".+"}


def as_bool_comparisons(expr: str) -> str:
    """`expr` with every comparison outside label matchers and strings made a `bool` comparison, so it
    returns its operands' series (0 or 1) instead of filtering them away."""
    out, depth, quote, i = [], 0, "", 0
    while i < len(expr):
        ch = expr[i]
        if quote:
            quote = "" if ch == quote and expr[i - 1] != "\\" else quote
        elif ch in "\"'`":
            quote = ch
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        elif depth == 0 and (m := _COMPARISON.match(expr, i)):
            out.append(m.group(1) + (m.group(2) or " bool"))
            i = m.end()
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def dashboard_expressions() -> list[tuple[str, str]]:
    found = []

    def walk(panels: list[dict], board: str) -> None:
        for panel in panels:
            walk(panel.get("panels", []), board)
            for target in panel.get("targets", []):
                if target.get("expr"):
                    found.append((f"{board}: {panel.get('title')}", target["expr"]))

    for path in DASHBOARDS:
        walk(json.loads(path.read_text())["panels"], path.stem)
    return found


def rule_expressions() -> list[tuple[str, str]]:
    rules = [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
    return [(rule.get("alert") or rule["record"], rule["expr"]) for rule in rules]


def substitute(expr: str) -> str:
    for name, value in sorted(_GRAFANA_VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(name, value)
    return expr


def alert_on(metric: str) -> str:
    """The one alert whose expression reads `metric`."""
    [name] = [name for name, expr in rule_expressions() if metric in expr and name[0].isupper()]
    return name


def test_bool_comparisons_leave_matchers_alone():
    assert as_bool_comparisons('x{a!="b"} > 0.9') == 'x{a!="b"} > bool 0.9'
    assert as_bool_comparisons("(a > 1) and (b >= bool 2)") == "(a > bool 1) and (b >= bool 2)"


# ---- a live pdserve, its Redis, and a Prometheus scraping it


def _replica_pids(root: int, deployment: str) -> list[int]:
    title = f"ray::ServeReplica:pdserve:{deployment}".encode()
    pids = []
    for pid in process_tree(root):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title):
                pids.append(pid)
        except OSError:
            continue
    return pids


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=3) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return 0


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """(pdserve serve process, its HTTP port, its Redis, a Prometheus scraping it), after light traffic."""
    tmp = tmp_path_factory.mktemp("prometheus-live")
    redis = RedisServer(workdir=tmp, password="prom-live-test").start()
    port, grpc_port = listen_port(), listen_port()
    log_path = tmp / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115
    serve = subprocess.Popen(
        [sys.executable, "-m", "pdserve.services.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_port),
         "--model", "tiny", "--redis-url", redis.url],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    prometheus = PrometheusServer(tmp, [f"127.0.0.1:{port}"], [RULES])
    try:
        deadline = time.monotonic() + 180
        while "pdserve is serving" not in log_path.read_text() or _health(port) != 200:
            assert serve.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "pdserve serve did not become healthy"
            time.sleep(1)
        prometheus.start()
        _traffic(port)
        prometheus.wait_for(lambda: prometheus.target_health() == ["up"], "scrape target up", 30)
        time.sleep(5)  # a few scrapes after the traffic: rate() over them has two samples or more
        yield serve, port, redis, prometheus
    finally:
        prometheus.stop()
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
        log.close()
        redis.stop()


def _traffic(port: int) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    for i in range(6):
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"Count to {i + 3}, please."}], max_tokens=12,
            stream=True, temperature=0)
        assert any(chunk.choices and chunk.choices[0].delta.content for chunk in stream)
        client.completions.create(model="tiny", prompt=f"Prometheus scrape {i} " * (8 * i + 1), max_tokens=6)


def test_every_dashboard_and_rule_expression_returns_a_series(live):
    _, _, _, prometheus = live
    expressions = dashboard_expressions() + rule_expressions()
    assert len(DASHBOARDS) >= 3 and len(expressions) > 20
    empty = []
    for where, expr in expressions:
        if "absent" in expr:
            continue  # absent(x) is empty exactly while x is there, which the scrape below checks
        query = as_bool_comparisons(substitute(expr))
        if not prometheus.query(query):
            empty.append(f"{where}: {query}")
    assert not empty, "expressions with no series:\n" + "\n".join(empty)
    # what the absent() alerts watch is there, so none of them is pending
    states = prometheus.alert_states()
    absent_alerts = [name for name, expr in rule_expressions() if "absent" in expr and name[0].isupper()]
    assert absent_alerts and not set(absent_alerts) & set(states), states


def test_decode_replica_killed_takes_its_alert_to_pending(live):
    serve, port, _, prometheus = live
    alert = alert_on("pdserve_router_live_replicas")
    assert alert not in prometheus.alert_states()
    [pid] = _replica_pids(serve.pid, "decode")
    os.kill(pid, signal.SIGKILL)
    state = prometheus.wait_for(lambda: prometheus.alert_states().get(alert), f"{alert} pending", 30)
    assert state in ("pending", "firing")
    # Serve's replacement comes up, and the alert clears
    prometheus.wait_for(lambda: _health(port) == 200 and alert not in prometheus.alert_states(),
                        f"{alert} cleared after the replacement", 180, interval=1)


def test_redis_killed_takes_its_alert_to_pending(live):
    _, port, redis, prometheus = live
    alert = alert_on("pdserve_redis_up")
    assert alert not in prometheus.alert_states()
    os.kill(redis.proc.pid, signal.SIGKILL)
    try:
        state = prometheus.wait_for(lambda: prometheus.alert_states().get(alert), f"{alert} pending", 30)
        assert state in ("pending", "firing")
        assert _health(port) == 200  # the Redis tier is a cache: requests are still served
    finally:
        redis.proc.wait()
        redis.proc = None
        redis.start()
    prometheus.wait_for(lambda: alert not in prometheus.alert_states(), f"{alert} cleared after restart", 60,
                        interval=1)
