"""`pdserve-loadtest soak`: N requests at a rate against a disaggregated system deployed here (as scenarios
deploy theirs), with a third of the clients leaving at a random point, a tenth sending invalid fields,
and one prefill and one decode replica killed (SIGKILL) mid-run. Every request ends in exactly one class:

- completed: HTTP 200, the exact number of tokens asked for (ignore_eos), then [DONE];
- failed_clean: a valid request answered with an OpenAI error (`{"error": {message, type}}`), as an HTTP
  status or as an SSE error event followed by [DONE]: 429/503 at any time, 5xx only if the request
  overlapped a kill window (from the kill to the replacement's start + `kill_grace_s`);
- rejected_bad_input: an invalid request answered 4xx with an OpenAI error body;
- disconnected: the client left as planned (before the first token, right after it, or mid-stream);
- unaccounted: anything else (a stream ending without [DONE] or error event, a wrong token count, a
  5xx outside kill windows, a bad input not answered 4xx, a non-OpenAI error body, a request still
  open at the deadline). The soak fails unless it is 0.

Migrations are not a class of their own: a migrated stream is completed (or disconnected) as its client
sees it; their count is the router's `pdserve_migrations_total` delta. After the load: 0 KV leases and
0 KV blocks in use on every replica once quiescent, and each surviving replica's RSS growth since warm-up
within `rss_growth_bound`. The exit code is 1 when any of the three fails."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from pdserve.loadtest import soak_system as sys_
from pdserve.loadtest.client import completion_body, new_client

# invalid fields, each answered 4xx by a correct server: (what, body change); None as body: not JSON at all
BAD_INPUTS: tuple[tuple[str, dict[str, Any] | None], ...] = (
    ("max_tokens_negative", {"max_tokens": -1}), ("temperature_string", {"temperature": "hot"}),
    ("top_p_above_one", {"top_p": 5.0}), ("prompt_empty", {"prompt": []}),
    ("prompt_negative_token", {"prompt": [-3, 1]}), ("n_zero", {"n": 0}),
    ("model_unknown", {"model": "no-such-model"}), ("stop_number", {"stop": 42}),
    ("stream_options_string", {"stream_options": "yes"}), ("max_tokens_huge", {"max_tokens": 10**9}),
    ("prompt_missing", {"prompt": ...}), ("not_json", None),
)
DISCONNECT_POINTS = ("before_first_token", "after_first_token", "mid_stream")


@dataclass(frozen=True)
class SoakConfig:
    num_requests: int = 2000
    rate: float = 10.0
    seed: int = 0
    prompt: Any = field(default_factory=lambda: {"dist": "uniform", "low": 40, "high": 200})
    output: Any = field(default_factory=lambda: {"dist": "uniform", "low": 8, "high": 48})
    disconnect_fraction: float = 1 / 3
    bad_fraction: float = 0.1
    kill: bool = True
    prefill_replicas: int = 2
    decode_replicas: int = 2
    warmup_requests: int = 100
    kill_grace_s: float = 10.0
    replace_bound_s: float = 120.0
    quiescence_bound_s: float = 5.0
    rss_growth_bound: float = 0.25
    max_duration_s: float | None = None  # None: twice the schedule + 120 s

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.rate <= 0 or self.disconnect_fraction + self.bad_fraction > 1:
            raise ValueError("soak needs num_requests >= 1, rate > 0 and disconnect + bad fractions <= 1")
        if min(self.prefill_replicas, self.decode_replicas) < (2 if self.kill else 1):
            raise ValueError("killing a replica of each role needs >= 2 replicas of each (streams must move)")

    def system(self, model: Any) -> dict[str, Any]:
        worker = {"num_cpus": 0.5, "num_blocks": 512}
        return {"model": model, "mode": "disaggregated", "transport": "ucx",
                "prefill": {**worker, "num_replicas": self.prefill_replicas},
                "decode": {**worker, "num_replicas": self.decode_replicas},
                "router": {"num_cpus": 0.25, "disaggregate_min_prompt_tokens": 16}}


@dataclass
class Outcome:
    index: int
    kind: str  # "valid" | "bad:<what>" | "disconnect:<point>"
    sent_s: float = 0.0
    ended_s: float | None = None
    http_status: int | None = None
    num_tokens: int = 0
    usage_tokens: int | None = None
    done: bool = False
    error_type: str | None = None
    left_at: str | None = None  # where a disconnecting client actually left
    note: str = ""
    verdict: str = "unaccounted"


def _openai_error(data: Any) -> str | None:
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str):
        return err["type"]
    return None


async def _stream(client: httpx.AsyncClient, url: str, body: Any, out: Outcome, leave_after: int | None) -> None:
    """Reads one response into `out`; returns early (closing the connection) after `leave_after` tokens."""
    kw = {"content": b'{"prompt": [1, 2'} if body is None else {"json": body}
    async with client.stream("POST", f"{url}/v1/completions", headers={"content-type": "application/json"},
                             **kw) as resp:
        out.http_status = resp.status_code
        if resp.status_code != 200:
            raw = await resp.aread()
            try:
                out.error_type = _openai_error(json.loads(raw))
            except ValueError:
                out.error_type = None
            out.note = raw[:200].decode("utf-8", "replace") if out.error_type is None else ""
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                out.done = True
                return
            data = json.loads(payload)
            if "error" in data:
                out.error_type = _openai_error(data) or "malformed"
            elif data.get("choices"):
                out.num_tokens += 1
                if leave_after is not None and out.num_tokens >= leave_after:
                    out.left_at = "after_first_token" if out.num_tokens == 1 else "mid_stream"
                    return
            elif data.get("usage"):
                out.usage_tokens = int(data["usage"]["completion_tokens"])


async def one_request(client: httpx.AsyncClient, url: str, body: Any, out: Outcome, t0: float,
                      rng: random.Random, output_len: int) -> None:
    out.sent_s = time.monotonic() - t0
    leave_after, timeout = None, None
    if out.kind == "disconnect:before_first_token":
        leave_after, timeout = 1, rng.uniform(0.0, 0.12)  # gone during admission, prefill or the handoff
    elif out.kind == "disconnect:after_first_token":
        leave_after = 1
    elif out.kind == "disconnect:mid_stream":
        leave_after = rng.randint(2, max(2, output_len - 1))
    try:
        if timeout is None:
            await _stream(client, url, body, out, leave_after)
        else:
            try:
                await asyncio.wait_for(_stream(client, url, body, out, leave_after), timeout)
            except TimeoutError:
                out.left_at = "before_first_token"
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        out.note = f"{type(exc).__name__}: {exc}"[:200]
    out.ended_s = time.monotonic() - t0


def classify(out: Outcome, expected_tokens: int, windows: list[tuple[float, float]]) -> str:
    in_window = any(a <= (out.ended_s or float("inf")) and out.sent_s <= b for a, b in windows)
    status, etype = out.http_status, out.error_type
    if out.kind.startswith("bad:"):
        return "rejected_bad_input" if status is not None and 400 <= status < 500 and etype else "unaccounted"
    if out.left_at is not None:
        return "disconnected"
    if status is not None and status != 200:
        clean = etype is not None and (status in (429, 503) or (status >= 500 and in_window))
        return "failed_clean" if clean else "unaccounted"
    if etype is not None and out.done:  # an error event after the 200, then [DONE]
        return "failed_clean" if etype in ("service_unavailable", "rate_limit_error") or in_window else "unaccounted"
    if out.done and out.num_tokens >= 1 and out.usage_tokens == expected_tokens:
        return "completed"
    return "unaccounted"


def plan(config: SoakConfig, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    kinds: list[str] = []
    num_bad = 0
    for _ in range(n):
        u = rng.random()
        if u < config.bad_fraction:  # every invalid field in turn
            kinds.append(f"bad:{BAD_INPUTS[num_bad % len(BAD_INPUTS)][0]}")
            num_bad += 1
        elif u < config.bad_fraction + config.disconnect_fraction:
            kinds.append(f"disconnect:{rng.choice(DISCONNECT_POINTS)}")
        else:
            kinds.append("valid")
    return kinds


def request_body(model: str, spec: Any, kind: str) -> Any:
    body = completion_body(model, spec)
    if not kind.startswith("bad:"):
        return body
    change = dict(BAD_INPUTS)[kind[4:]]
    if change is None:
        return None
    for key, value in change.items():
        if value is ...:
            body.pop(key)
        else:
            body[key] = value
    return body


async def drive(url: str, model: str, specs: list[Any], kinds: list[str], schedule: list[float],
                deadline_s: float, seed: int, kills: list[sys_.Kill], app: str, config: SoakConfig,
                log: Any, rss_samples: list[dict[str, Any]] | None = None) -> tuple[list[Outcome], float]:
    rss_samples = [] if rss_samples is None else rss_samples
    outcomes = [Outcome(i, k) for i, k in enumerate(kinds)]
    rng = random.Random(seed + 1)
    async with new_client(512) as client:
        t0 = time.monotonic()

        async def timed(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + schedule[i] - time.monotonic()))
            await one_request(client, url, request_body(model, specs[i], kinds[i]), outcomes[i], t0,
                              random.Random(rng.random()), specs[i].output_len)

        tasks = [asyncio.create_task(timed(i)) for i in range(len(specs))]
        killers = [asyncio.create_task(sys_.run_kill(k, app, t0, random.Random(seed + 2 + j),
                                                     config.replace_bound_s, log)) for j, k in enumerate(kills)]
        sampler = asyncio.create_task(sys_.sample_rss(app, t0, 10.0, rss_samples))
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for o in outcomes:
            if o.ended_s is None:
                o.note = o.note or "still open at the deadline"
        duration = time.monotonic() - t0
        await asyncio.gather(*killers, return_exceptions=True)
        sampler.cancel()
    return outcomes, duration


def tally(outcomes: list[Outcome], specs: list[Any], windows: list[tuple[float, float]]) -> dict[str, Any]:
    for o, spec in zip(outcomes, specs):
        o.verdict = classify(o, spec.output_len, windows)
    verdicts = Counter(o.verdict for o in outcomes)
    accounting = {k: verdicts.get(k, 0) for k in
                  ("completed", "failed_clean", "rejected_bad_input", "disconnected", "unaccounted")}
    accounting["total"] = len(outcomes)
    failed = Counter(f"{o.http_status}:{o.error_type}" for o in outcomes if o.verdict == "failed_clean")
    rejected = Counter(f"{o.http_status}:{o.error_type}" for o in outcomes if o.verdict == "rejected_bad_input")
    left = Counter(f"{o.kind.split(':')[1]}->{o.left_at}" for o in outcomes if o.verdict == "disconnected")
    planned = Counter(o.kind.split(":")[0] for o in outcomes)
    bad = [asdict(o) for o in outcomes if o.verdict == "unaccounted"]
    return {"accounting": accounting, "planned": dict(planned), "failed_clean_by": dict(failed),
            "rejected_by": dict(rejected), "disconnected_by": dict(left), "unaccounted_examples": bad[:20]}


def add_soak_args(p: Any) -> None:
    d = SoakConfig()
    p.add_argument("-n", "--num-requests", type=int, default=d.num_requests)
    p.add_argument("--rate", type=float, default=d.rate, help="mean requests/s (Poisson arrivals)")
    p.add_argument("--model", default="tiny", help="'tiny' or a checkpoint directory")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--prefill-replicas", type=int, default=d.prefill_replicas)
    p.add_argument("--decode-replicas", type=int, default=d.decode_replicas)
    p.add_argument("--disconnect-fraction", type=float, default=d.disconnect_fraction)
    p.add_argument("--bad-fraction", type=float, default=d.bad_fraction)
    p.add_argument("--no-kill", action="store_true", help="no replica kills (a baseline)")
    p.add_argument("--warmup", type=int, default=d.warmup_requests, help="valid requests before the RSS baseline")
    p.add_argument("--rss-growth-bound", type=float, default=d.rss_growth_bound, help="per replica, after warm-up")
    p.add_argument("--quiescence-bound", type=float, default=d.quiescence_bound_s, help="s to reach 0 leases/blocks")
    p.add_argument("--max-duration", type=float, help="wall-clock bound of the load (s); default 2x schedule + 120")
    p.add_argument("--port", type=int, default=0, help="Serve HTTP port when Serve is started here")
    p.add_argument("--out", type=Path, required=True, help="summary.json and summary.md go here")
