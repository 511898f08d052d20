"""Async streaming OpenAI completions client: one request in, one RequestResult out (never raises).

Timing follows `vllm bench serve`: the clock starts just before the POST; every SSE chunk that
carries a choice is one token arrival (TTFT at the first, an ITL gap at each later one); the
output token count comes from the final usage chunk.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from pdserve.loadtest.workloads import RequestSpec

Status = Literal["ok", "rejected", "error", "cancelled"]
REJECT_STATUSES = (429, 503)


@dataclass
class RequestResult:
    index: int
    prompt_len: int
    expected_output_len: int
    scheduled_s: float  # when the request was due, from the run start
    sent_s: float | None = None  # when it went out, from the run start
    status: Status = "cancelled"
    http_status: int | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token chunk, from sent_s
    e2e_s: float | None = None
    output_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prompt tokens served from cache
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def completion_body(model: str, spec: RequestSpec) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": list(spec.prompt_ids),
        "max_tokens": spec.output_len,
        "min_tokens": spec.output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send(
    client: httpx.AsyncClient, base_url: str, model: str, spec: RequestSpec, result: RequestResult, t0: float
) -> RequestResult:
    """Fills `result` in place, so a request cancelled mid-stream keeps what it saw (status stays 'cancelled')."""
    sent = time.perf_counter()
    result.sent_s = sent - t0
    usage_tokens: int | None = None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=completion_body(model, spec)) as resp:
            result.http_status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")[:500]
                result.status = "rejected" if resp.status_code in REJECT_STATUSES else "error"
                result.error = f"HTTP {resp.status_code}: {body}"
                result.e2e_s = time.perf_counter() - sent
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if "error" in data:
                    raise RuntimeError(f"error in stream: {data['error'].get('message')}")
                if data.get("choices"):
                    result.chunk_times.append(now - sent)
                elif data.get("usage"):
                    usage_tokens = int(data["usage"]["completion_tokens"])
                    result.cached_tokens = cached_tokens(data["usage"])
        result.e2e_s = time.perf_counter() - sent
        result.output_tokens = usage_tokens if usage_tokens is not None else len(result.chunk_times)
        if not result.chunk_times:
            raise RuntimeError("the stream carried no tokens")
        result.status = "ok"
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError, TypeError) as exc:
        result.status = "error"
        result.error = f"{type(exc).__name__}: {exc}"
        result.e2e_s = time.perf_counter() - sent
    return result


def cached_tokens(usage: dict[str, Any]) -> int:
    """usage.prompt_tokens_details.cached_tokens; 0 when the server leaves it out (null or absent)."""
    details = usage.get("prompt_tokens_details") or {}
    if not isinstance(details, dict):
        raise TypeError(f"prompt_tokens_details is not an object: {details!r}")
    value = details.get("cached_tokens") or 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"cached_tokens is not a count: {value!r}")
    return value


def new_client(max_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    # no read timeout: the run's deadline bounds every request
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30.0), trust_env=False)


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]
