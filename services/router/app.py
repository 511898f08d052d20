"""Router deployment: OpenAI-compatible FastAPI ingress relaying prefill + decode token streams."""

# No `from __future__ import annotations`: Serve pickles the ingress class by value, and FastAPI must
# see real annotation objects (`Request`), not strings resolved against a trimmed globals dict.

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pdserve.models.tiny import resolve_model_path
from pdserve.models.tokenizer import Tokenizer
from pdserve.services.router import openai_api as oa
from pdserve.services.router.admission import Prepared, check_auth, params_to_dict, prepare, read_json
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.errors import APIError, error_body
from pdserve.services.router.grpc_api import GrpcServiceMixin
from pdserve.services.router.metrics import CONTENT_TYPE, RouterMetrics
from pdserve.services.router.policy import decide
from pdserve.services.router.streaming import first_event, prepend, sse_stream, upstream_error
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

REQUEST_ID_HEADER = "x-request-id"


class RequestIdMiddleware:
    """Pure ASGI (streams pass through untouched): the request id is X-Request-Id or a fresh one.

    The Serve proxy already honours X-Request-Id (generating one when absent, so replicas always see
    it) and echoes it on the response; echoing here as well would send the header twice.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or ()).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
            request_id = given[:128] if given and given.isprintable() else uuid.uuid4().hex
            scope.setdefault("state", {})["request_id"] = request_id
        await self.app(scope, receive, send)


fastapi_app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, openapi_url=None)
fastapi_app.add_middleware(RequestIdMiddleware)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), "invalid_request_error"), status_code=exc.status_code)


def _model_vocab_size(model_dir: Path, tokenizer: Tokenizer) -> int:
    config_file = model_dir / "config.json"
    if config_file.is_file():
        vocab = json.loads(config_file.read_text(encoding="utf-8")).get("vocab_size")
        if isinstance(vocab, int):
            return vocab
    return tokenizer.vocab_size


@serve.deployment(name="router")
@serve.ingress(fastapi_app)
class RouterDeployment(GrpcServiceMixin):
    def __init__(
        self, config: dict[str, Any], prefill: DeploymentHandle | None, decode: DeploymentHandle
    ) -> None:
        self.config = RouterConfig.model_validate(config)
        self.api_keys = self.config.resolved_api_keys()
        self.prefill = prefill
        self.decode = decode
        model_dir = resolve_model_path(self.config.model)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.vocab_size = _model_vocab_size(model_dir, self.tokenizer)
        self.metrics = RouterMetrics()
        self.num_inflight = 0
        self.created = int(time.time())
        self._background: set[asyncio.Task] = set()

    # ---- open endpoints

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        handles = [self.decode] + ([self.prefill] if self.config.mode == "disaggregated" and self.prefill else [])
        try:
            await asyncio.wait_for(asyncio.gather(*(h.stats.remote() for h in handles)),
                                   self.config.health_timeout_s)
        except Exception as exc:  # any failing path means no healthy serving path
            return JSONResponse(error_body(f"unhealthy: {type(exc).__name__}: {exc}", "service_unavailable"),
                                status_code=503, headers={"Retry-After": str(self.config.retry_after_s)})
        return JSONResponse({"status": "ok", "mode": self.config.mode})

    @fastapi_app.get("/metrics")
    async def metrics_endpoint(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # ---- OpenAI API

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            check_auth(request, self.api_keys)
        except APIError as err:
            return self._reject(err, "models")
        return JSONResponse(oa.model_list(self.config.served_model_name, self.config.max_model_len, self.created))

    @fastapi_app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    @fastapi_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            check_auth(request, self.api_keys)
            data = await read_json(request, self.config.max_body_bytes)
            prepared, meta, events = self._start(data, chat, request.state.request_id)
            first = await first_event(events, self.config.retry_after_s)
        except APIError as err:
            return self._reject(err, endpoint)
        self.metrics.requests.labels(endpoint, "200").inc()
        events = prepend(first, events)
        if prepared.stream:
            return StreamingResponse(sse_stream(meta, prepared, events, self.tokenizer),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            choices = [oa.Choice(i) for i in range(prepared.n)]
            async for index, event in events:
                choices[index].add(event)
            return JSONResponse(oa.response_body(meta, choices, len(prepared.prompt_token_ids), self.tokenizer,
                                                 prepared.want_logprobs))
        except Exception as exc:
            err = upstream_error(exc, self.config.retry_after_s)
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        finally:
            await events.aclose()

    def _start(
        self, data: dict[str, Any], chat: bool, request_id: str
    ) -> tuple[Prepared, oa.ResponseMeta, AsyncIterator[tuple[int, dict]]]:
        """Admits a parsed body (raises APIError, touching no engine) and starts it. The caller must
        iterate or `aclose()` the returned (choice index, event) stream: closing aborts everywhere."""
        prepared = prepare(data, chat, self.config, self.tokenizer, self.vocab_size)
        if self.num_inflight >= self.config.max_inflight:
            raise APIError(429, f"too many requests in flight ({self.config.max_inflight}); retry later",
                           code="too_many_requests", reason="overloaded",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        meta = oa.ResponseMeta(("chatcmpl-" if chat else "cmpl-") + request_id, self.config.served_model_name, chat)
        decision = decide(self.config.mode, len(prepared.prompt_token_ids), self.config.disaggregate_min_prompt_tokens,
                          self.prefill is not None)
        self.metrics.decisions.labels("disaggregate" if decision.disaggregate else "skip", decision.reason).inc(prepared.n)
        self.metrics.prompt_tokens.inc(len(prepared.prompt_token_ids) * prepared.n)
        return prepared, meta, self._merged(request_id, prepared, decision.disaggregate)

    def _reject(self, err: APIError, endpoint: str) -> JSONResponse:
        self.metrics.rejections.labels(err.reason).inc()
        self.metrics.requests.labels(endpoint, str(err.status)).inc()
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    def _enter(self) -> None:
        self.num_inflight += 1
        self.metrics.inflight.set(self.num_inflight)

    def _exit(self) -> None:
        self.num_inflight -= 1
        self.metrics.inflight.set(self.num_inflight)

    # ---- streams

    async def _merged(self, request_id: str, p: Prepared, disaggregate: bool) -> AsyncIterator[tuple[int, dict]]:
        """(choice index, event) from n sub-requests; closing it cancels them all (engines abort, KV frees)."""
        start = time.monotonic()
        first_seen = False
        self._enter()  # here, not at admission: a stream closed before its first step never ran this body
        try:
            if p.n == 1:
                async with aclosing(self._run_one(request_id, p.prompt_token_ids, p.params, disaggregate)) as one:
                    async for event in one:
                        if not first_seen and event.get("token_ids"):
                            first_seen = True
                            self.metrics.ttft.observe(time.monotonic() - start)
                        self.metrics.generation_tokens.inc(len(event.get("token_ids") or ()))
                        yield 0, event
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int) -> None:
                try:
                    one = self._run_one(f"{request_id}-{i}", p.prompt_token_ids, p.params_for(i), disaggregate)
                    async with aclosing(one):
                        async for event in one:
                            queue.put_nowait((i, event))
                    queue.put_nowait((i, None))
                except Exception as exc:
                    queue.put_nowait((i, exc))

            tasks = [asyncio.create_task(pump(i)) for i in range(p.n)]
            try:
                remaining = p.n
                while remaining:
                    i, event = await queue.get()
                    if event is None:
                        remaining -= 1
                        continue
                    if isinstance(event, Exception):
                        raise event
                    if not first_seen and event.get("token_ids"):
                        first_seen = True
                        self.metrics.ttft.observe(time.monotonic() - start)
                    self.metrics.generation_tokens.inc(len(event.get("token_ids") or ()))
                    yield i, event
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self.metrics.e2e.observe(time.monotonic() - start)
            self._exit()

    async def _run_one(
        self, request_id: str, prompt_ids: list[int], params, disaggregate: bool
    ) -> AsyncIterator[dict[str, Any]]:
        request = {"request_id": request_id, "prompt_token_ids": prompt_ids, "params": params_to_dict(params)}
        handoff = first_token_id = stream = None
        finished = imported = False
        try:
            if disaggregate:
                first = await self.prefill.prefill.remote(request)
                handoff, first_token_id = first["handoff"], first["first_token_id"]
                first_token = {"token_ids": [first_token_id], "text": first["text"], "finished": False,
                               "logprobs": first["logprobs"], "top_logprobs": first["top_logprobs"]}
                if first["finish_reason"] is not None or handoff is None:
                    finished = handoff is None
                    yield {**first_token, "finished": True, "finish_reason": first["finish_reason"]}
                    return
                stream = self.decode.options(stream=True).generate.remote(request, handoff, first_token_id)
                yield first_token
            else:
                stream = self.decode.options(stream=True).generate.remote(request)
            async for event in stream:
                imported = True
                if "fallback" in event:
                    self.metrics.fallbacks.labels(event["fallback"]).inc()
                    continue
                finished = bool(event.get("finished"))
                yield event
        finally:
            if not finished:
                if stream is not None:
                    stream.cancel()
                if handoff is not None and not imported:
                    # decode never confirmed the pull: the prefill lease would otherwise wait for its TTL
                    self._spawn(self.prefill.abort.remote(handoff["lease_id"]))

    def _spawn(self, response) -> None:
        async def wait() -> None:
            try:
                await response
            except Exception:
                pass

        task = asyncio.get_running_loop().create_task(wait())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def build_app(
    config: RouterConfig | dict[str, Any], prefill_app: Application | None, decode_app: Application
) -> Application:
    """The router bound to its prefill (None in colocated mode) and decode applications."""
    cfg = config if isinstance(config, RouterConfig) else RouterConfig.model_validate(config)
    if cfg.mode == "disaggregated" and prefill_app is None:
        raise ValueError("disaggregated mode needs a prefill application")
    return RouterDeployment.options(
        num_replicas=cfg.num_replicas, ray_actor_options={"num_cpus": cfg.num_cpus},
        # headroom over max_inflight, so the router itself sees the overflow and answers 429 at once
        # instead of Serve's proxy queueing it silently
        max_ongoing_requests=cfg.max_inflight + 32,
    ).bind(cfg.model_dump(), prefill_app if cfg.mode == "disaggregated" else None, decode_app)
