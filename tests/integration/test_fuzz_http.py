"""Schemathesis fuzzes the router's OpenAPI document as the live app serves it (/openapi.json through the
Serve proxy): positive and negative bodies for /v1/completions and /v1/chat/completions, plus the GET
endpoints, against a real router + prefill + decode app (redis KV transport, the `tiny` model).

Every response is below 500 and conforms to the document (status, content type, schema); every error is an
OpenAI error body that names no internals, with the request's X-Request-Id echoed; negative bodies are
rejected with a 4xx; a 200 stream carries no error event and ends with [DONE]. Afterwards nothing is left
running: no request in flight at the router, no sequence, block or lease on either worker.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("ray")
schemathesis = pytest.importorskip("schemathesis")
requests = pytest.importorskip("requests")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from pdserve.services.decode.app import build_app as build_decode  # noqa: E402
from pdserve.services.prefill.app import build_app as build_prefill  # noqa: E402
from pdserve.services.router import RouterConfig, build_app  # noqa: E402
from pdserve.services.worker import WorkerConfig  # noqa: E402


def _fuzz_checks():
    """fuzz_checks.py beside this file (pytest's importlib mode puts no test folder on sys.path)."""
    name = "pdserve_tests_fuzz_checks"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("fuzz_checks.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


fuzz = _fuzz_checks()

APP = "fuzz-http"
KEY = "sk-fuzz-http"
MAX_MODEL_LEN = 2048
MAX_TOKENS = 6  # generated max_tokens at or under the context limit are capped to this, so cases stay fast
# (path, method, mode) -> examples; GET endpoints without parameters have one distinct case each
PLAN = {
    ("/v1/completions", "POST", GenerationMode.POSITIVE): 260,
    ("/v1/completions", "POST", GenerationMode.NEGATIVE): 260,
    ("/v1/chat/completions", "POST", GenerationMode.POSITIVE): 260,
    ("/v1/chat/completions", "POST", GenerationMode.NEGATIVE): 260,
    ("/v1/models", "GET", GenerationMode.POSITIVE): 5,
    ("/health", "GET", GenerationMode.POSITIVE): 5,
    ("/metrics", "GET", GenerationMode.POSITIVE): 5,
}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(ray_serve, redis_server):
    workers = WorkerConfig(transport="redis", redis_url=redis_server.url, num_cpus=0.5)
    router = RouterConfig(api_keys=(KEY,), num_cpus=0.25, default_max_tokens=4, max_model_len=MAX_MODEL_LEN,
                          max_choices_per_request=16, disaggregate_min_prompt_tokens=16)
    ray_serve.run(build_app(router, build_prefill(workers), build_decode(workers)), name=APP, route_prefix=f"/{APP}")
    yield f"http://127.0.0.1:{ray_serve.http_port}/{APP}"
    ray_serve.delete(APP)


def error_problems(body, sent) -> list[str]:
    """What is wrong with an OpenAI error body, or []."""
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return [f"not an OpenAI error body: {body!r:.300}"]
    error = body["error"]
    problems = []
    if set(error) != ERROR_KEYS:
        problems.append(f"error keys {sorted(error)}")
    if not isinstance(error.get("message"), str) or not error["message"]:
        problems.append("no message")
    if not isinstance(error.get("type"), str) or not error["type"]:
        problems.append("no type")
    for key in ("param", "code"):
        if error.get(key) is not None and not isinstance(error[key], str):
            problems.append(f"{key} is {error[key]!r}")
    if leaked := fuzz.leaked_internals(str(error.get("message")), sent):
        problems.append(f"internals in the message: {leaked}")
    return problems


def sse_problems(text: str, sent) -> list[str]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return [f"stream does not end with [DONE]: {text[-200:]!r}"]
    problems = []
    for event in events[:-1]:
        chunk = json.loads(event)
        if "error" in chunk:
            problems.append(f"error event in a 200 stream: {chunk}")
            problems += error_problems(chunk, sent)
    return problems


def shape(case, mode: GenerationMode, model: str) -> None:
    """Positive bodies: the served model (or none) most of the time, so they reach the engine, and short
    generations; a max_tokens over the context limit stays, to be refused. Negative bodies stay as generated."""
    if not mode.is_positive or not isinstance(case.body, dict):
        return
    body = dict(case.body)
    if model == "served":
        body["model"] = "tiny"
    elif model == "absent":
        body.pop("model", None)
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] <= MAX_MODEL_LEN:
            body[key] = min(body[key], MAX_TOKENS)
    case.body = body


def test_schemathesis_fuzz_of_the_openapi_document(server, ray_serve):
    # an explicit config (no schemathesis.toml discovery); streams are read to their end
    config = schemathesis.Config.from_dict({"max-stream-events": 1_000_000})
    schema = schemathesis.openapi.from_url(f"{server}/openapi.json", config=config, timeout=30)
    session = requests.Session()
    statuses: Counter = Counter()
    counts: Counter = Counter()
    failures: list[tuple[str, str]] = []  # (kind, details)

    def run(path: str, method: str, mode: GenerationMode, num: int) -> None:
        operation = schema[path][method]

        @settings(max_examples=num, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(mode), model=st.sampled_from(["served", "served", "absent", "generated"]))
        def one(case, model):
            shape(case, mode, model)
            request_id = f"fuzz-{sum(counts.values())}"
            counts[path, method, mode.value] += 1
            try:
                response = case.call(base_url=server, session=session, timeout=120,
                                     headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": request_id})
            except requests.RequestException as exc:  # a hang or a dropped connection
                failures.append((f"{path} {mode.value}: {type(exc).__name__}", _repro(case)))
                return
            statuses[response.status_code] += 1
            problems = []
            try:
                case.validate_response(response, checks=CHECKS)
            except FailureGroup as group:
                problems += [f"{type(e).__name__}: {str(e)[:300]}" for e in group.exceptions]
            except AssertionError as exc:
                problems.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            if response.status_code >= 400:
                problems += error_problems(_json(response), case.body)
                if _header(response, "x-request-id") != request_id:
                    problems.append(f"x-request-id {_header(response, 'x-request-id')!r}, sent {request_id}")
            elif _header(response, "content-type").startswith("text/event-stream"):
                problems += sse_problems(response.content.decode(), case.body)
                if response.stream_cut_short:
                    problems.append("the stream was not read to its end")
            if problems:
                failures.append((f"{path} {mode.value} -> {response.status_code}: {problems[0][:160]}",
                                 f"{problems}\n{response.content[:300]!r}\n{_repro(case)}"))

        one()

    for (path, method, mode), num in PLAN.items():
        run(path, method, mode, num)

    total = sum(counts.values())
    print(json.dumps({"cases": total, "by_operation": {" ".join(k): v for k, v in counts.items()},
                      "statuses": {str(k): v for k, v in sorted(statuses.items())}, "failures": len(failures)}))
    assert not failures, f"{len(failures)} of {total} cases failed; by kind, with an example:\n" + "\n\n".join(
        f"[{num}x] {kind}\n{dict(failures)[kind]}" for kind, num in Counter(k for k, _ in failures).most_common())
    assert total >= 1000 and statuses[200] > 0 and statuses[400] > 0, (counts, statuses)
    assert not any(status >= 500 for status in statuses)
    print(json.dumps({"after": fuzz.assert_idle(server, ray_serve, APP)}))
    assert requests.get(f"{server}/health", timeout=30).status_code == 200


def _repro(case) -> str:
    """The request as sent (schemathesis' curl command masks every field with "token" in its name)."""
    body = json.dumps(case.body, ensure_ascii=True, default=repr)[:1500] if case.body is not None else ""
    return f"{case.method} {case.path} {body}"


def _header(response, name: str) -> str:
    """schemathesis' responses keep headers lowercased, as lists."""
    return ",".join(response.headers.get(name, ()))


def _json(response):
    try:
        return json.loads(response.content)
    except ValueError:
        return response.content[:300]
