"""Router deployment: OpenAI-compatible FastAPI ingress relaying prefill + decode token streams."""

# No `from __future__ import annotations`: Serve pickles the ingress class by value, and FastAPI must
# see real annotation objects (`Request`), not strings resolved against a trimmed globals dict.

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pdserve.models.resolve import resolve_model_path
from pdserve.models.tokenizer import Tokenizer
from pdserve.services.router import openai_api as oa
from pdserve.latency_model import LatencyProfile
from pdserve.services.router.admission import Admission, Prepared
from pdserve.services.router.config import RouterConfig
from pdserve.services.router.dashboard import RouterDashboard
from pdserve.services.router.dashboard_page import PAGE as DASHBOARD_PAGE
from pdserve.services.router.dispatch import DispatchMixin, prediction_attributes
from pdserve.services.router.errors import APIError, error_body, install_error_handlers
from pdserve.services.router.grpc_api import GrpcServiceMixin
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from pdserve.observability import trace_attributes as ta
from pdserve.observability.metrics import CONTENT_TYPE
from pdserve.services.router.metrics import APIMetrics
from pdserve.services.router.middleware import RequestIdMiddleware
from pdserve.services.router.openapi_schema import install_openapi
from pdserve.observability.slo import SloWindow
from pdserve.observability.telemetry import Telemetry
from pdserve.placement.policy import Placement, PlacementConfig, PlacementRequest, Rejection
from pdserve.placement.queue import PlacementQueue
from pdserve.placement.sync import create_sync
from pdserve.services.router.placer import Placer
from pdserve.services.router.redis_tier import RedisTierWatch
from pdserve.services.router.workers import Workers
from pdserve.worklink import LinkClient
from pdserve.services.router.streaming import SSEResponse, first_event, prepend, sse_stream, upstream_error
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

fastapi_app = FastAPI(title="pdserve router", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
fastapi_app.add_middleware(RequestIdMiddleware)
install_openapi(fastapi_app)
install_error_handlers(fastapi_app)  # an unexpected exception: an OpenAI 500, not a plain-text page


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


def _app_name() -> str:
    try:
        return serve.get_replica_context().app_name
    except Exception:  # not inside a Serve replica
        return "default"


@serve.deployment(name="router")
@serve.ingress(fastapi_app)
class RouterDeployment(GrpcServiceMixin, DispatchMixin):
    def __init__(
        self, config: dict[str, Any], prefill: DeploymentHandle | None, decode: DeploymentHandle,
        kvstore: DeploymentHandle | None = None,
    ) -> None:
        self.config = RouterConfig.model_validate(config)
        self.kvstore = kvstore  # the Redis tier's index, when there is one
        model_dir = resolve_model_path(self.config.model)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.admission = Admission(self.config, self.tokenizer, _model_vocab_size(model_dir, self.tokenizer))
        slo = SloWindow(self.config.slo_window_s, self.config.slo_ttft_s, self.config.slo_tpot_s)
        self.telemetry = Telemetry("router", self.config.served_model_name, self.config.tracing_env, slo=slo)
        self.metrics = self.telemetry.metrics
        self.api_metrics = APIMetrics(self.metrics.registry)
        self._worker_snapshots: dict[str, tuple[float, dict]] = {}  # replica -> (monotonic time, snapshot)
        placement = PlacementConfig.model_validate({
            "disaggregate_min_prompt_tokens": self.config.disaggregate_min_prompt_tokens, **self.config.placement})
        profile = LatencyProfile.from_dict(self.config.profile) if self.config.profile else None
        self.placer = Placer(placement, profile, _app_name(), prefill is not None,
                             workers={"prefill": prefill, "decode": decode}, kvstore=kvstore,
                             links=LinkClient() if self.config.worker_link else None,
                             on_poll=self.api_metrics.count_stats_poll,
                             sync=create_sync(self.config.placement_sync, self.config.redis_url,
                                              f"pdserve:placements:{_app_name()}",
                                              self.config.placement_sync_flush_ms / 1e3))
        self.queue = PlacementQueue(self.config.queue_max_requests, self.config.queue_timeout_s,
                                    placement.stats_poll_period_s)
        self.api_metrics.watch_queue(self.metrics.registry, self.queue)
        self.api_metrics.watch_sync(self.metrics.registry, self.placer.sync)
        self.workers = Workers(prefill, decode, self.placer.poller, self.api_metrics.count_worker_call)
        self.dashboard = RouterDashboard(self.config, self.metrics.registry, self._worker_snapshots, self.placer.poller,
                                         self._fresh_worker_snapshots)
        self.api_metrics.watch_replicas(self.metrics.registry, lambda role: len(self.placer.poller.snapshots(role)),
                                        ("prefill", "decode") if prefill is not None else ("decode",))
        self.num_inflight = 0
        self.created = int(time.time())
        self._background: set[asyncio.Task] = set()
        self.redis_tier = RedisTierWatch(kvstore) if kvstore is not None else None
        if self.redis_tier is not None:
            self.metrics.watch_redis(self.redis_tier)

    async def __del__(self) -> None:
        """Serve's graceful shutdown: stop polling, close the worker links, flush the tracer."""
        await self.placer.close()
        if self.redis_tier is not None:
            await self.redis_tier.close()
        if self.workers.links is not None:
            await self.workers.links.close()
        self.telemetry.close()

    # ---- open endpoints

    @fastapi_app.get("/health")
    async def health(self) -> Response:
        """Answers from state the router keeps, never from a call that could wait on a dead replica:
        the stats poller's live replicas per role (a replica whose actor died drops out at once), after
        at most `health_timeout_s` for the first poll. 503 with Retry-After while a role the mode needs
        has no live replica. A Redis tier that is down (cache only: requests are still served) makes the
        status "degraded"."""
        poller = self.placer.poller
        await poller.ready(self.config.health_timeout_s)
        roles = {"decode": len(poller.snapshots("decode"))}
        if self.workers.prefill_handle is not None and self.config.mode == "disaggregated":
            roles["prefill"] = len(poller.snapshots("prefill"))
        tier = {}
        if self.redis_tier is not None:
            self.redis_tier.start()
            tier = {"redis": self.redis_tier.state()}
        missing = [role for role, n in roles.items() if n == 0]
        if missing:
            body = error_body(f"unhealthy: no live {' or '.join(missing)} replica", "service_unavailable")
            return JSONResponse({**body, "replicas": roles, **tier}, status_code=503,
                                headers={"Retry-After": str(self.config.retry_after_s)})
        status = "degraded" if tier.get("redis", {}).get("status") == "down" else "ok"
        return JSONResponse({"status": status, "mode": self.config.mode, "replicas": roles, **tier})

    @fastapi_app.get("/metrics")
    async def metrics_endpoint(self) -> Response:
        return Response(self.metrics.render(await self._fresh_worker_snapshots()), media_type=CONTENT_TYPE)

    @fastapi_app.get("/dashboard", include_in_schema=False)
    async def dashboard_page(self) -> Response:
        """The live SLA dashboard: one page polling /dashboard/data (services/router/dashboard.py)."""
        return HTMLResponse(DASHBOARD_PAGE)

    @fastapi_app.get("/dashboard/data", include_in_schema=False)
    async def dashboard_data(self) -> Response:
        return JSONResponse(self.dashboard.data())

    async def _fresh_worker_snapshots(self) -> list[dict]:
        """One snapshot from every live worker replica the stats poller knows (each call names its
        replica, which PlacementRequestRouter honours), or from whichever replica answers before it
        knows any; a call gets `health_timeout_s`, so /metrics never waits on a dead replica. A replica
        that is gone leaves the exposition at once; one slow to answer keeps its last snapshot for up
        to `metrics_staleness_s`."""
        self.placer.start()
        calls, live = [], set()
        for role, handle in (("prefill", self.workers.prefill_handle), ("decode", self.workers.decode_handle)):
            if handle is None:
                continue
            replicas = [s.replica for s in self.placer.poller.snapshots(role)]
            live.update(replicas)
            calls += [handle.metrics_snapshot.remote({"replica": r}) for r in replicas] or [
                handle.metrics_snapshot.remote()]
        timeout = self.config.health_timeout_s
        replies = await asyncio.gather(*(asyncio.wait_for(self._await(c), timeout) for c in calls),
                                       return_exceptions=True)
        now = time.monotonic()
        for reply in replies:
            if isinstance(reply, dict):
                self._worker_snapshots[reply["replica"]] = (now, reply["metrics"])
                live.add(reply["replica"])
        for replica, (seen, _) in list(self._worker_snapshots.items()):
            if replica not in live or now - seen > self.config.metrics_staleness_s:
                del self._worker_snapshots[replica]
        return [snapshot for _, snapshot in self._worker_snapshots.values()]

    @fastapi_app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self.admission.authorize(request.headers.get("authorization", ""))
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
            prepared = await self.admission.http(request, chat, self.num_inflight)
            parent = self.telemetry.tracing.context_from_headers(request.headers)
            meta, events = await self._start(prepared, request.state.request_id, parent)
            first = await first_event(events, self.config.retry_after_s)
        except APIError as err:
            return self._reject(err, endpoint)
        except asyncio.CancelledError:  # the client left before the response started
            self.api_metrics.requests.labels(endpoint, "client_disconnected").inc()
            raise
        events = prepend(first, events)
        count = self.api_metrics.requests.labels
        if prepared.stream:  # counted when it ends: a failure after the 200 has a label of its own
            return SSEResponse(sse_stream(meta, prepared, events, self.tokenizer, self.config.stream_interval_s,
                                          self.api_metrics.count_write, lambda s: count(endpoint, s).inc()))
        try:
            choices = [oa.Choice(i, prepared.echo_of(i), prompt_token_ids=prepared.echo_ids_of(i))
                       for i in range(prepared.num_choices)]
            async for index, event in events:
                choices[index].add(event)
            body = oa.response_body(meta, choices, prepared.num_prompt_tokens, self.tokenizer,
                                    prepared.want_logprobs, prepared.n, prepared.tools)
            count(endpoint, "200").inc()
            return JSONResponse(body)
        except Exception as exc:
            err = upstream_error(exc, self.config.retry_after_s)
            count(endpoint, str(err.status)).inc()
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        finally:
            await events.aclose()

    async def _start(
        self, prepared: Prepared, request_id: str, parent=None
    ) -> tuple[oa.ResponseMeta, AsyncIterator[tuple[int, dict]]]:
        """Places an admitted request (raises APIError(429) when no replica meets its SLOs) and starts it
        under a SERVER span (child of `parent`, the caller's trace context). The caller must iterate or
        `aclose()` the returned (choice index, event) stream: closing aborts everywhere."""
        chat = prepared.chat
        meta = oa.ResponseMeta(("chatcmpl-" if chat else "cmpl-") + request_id, self.config.served_model_name, chat)
        tracing = self.telemetry.tracing
        span = tracing.start_span(ta.request_span_name(ta.operation_name(chat), meta.model), context=parent,
                                  kind=SpanKind.SERVER, attributes=self._request_attributes(prepared, meta, request_id))
        with tracing.span(ta.SPAN_ROUTE, context=trace.set_span_in_context(span)) as route:
            try:
                placements = [await self._place(prepared, ids, request_id) for ids in prepared.prompts]
            except APIError as err:
                self.placer.done(request_id)  # an earlier prompt's placement, if any, never runs
                span.set_status(trace.StatusCode.ERROR, err.message)
                span.end()
                raise
            placement = placements[0]  # the first prompt's describes the span
            attributes = {ta.DISAGGREGATE: placement.disaggregate, ta.DECISION_REASON: placement.reason,
                          "pdserve.placement.policy": self.placer.policy_name}
            if placement.prefill_replica:
                attributes[ta.PREFILL_REPLICA] = placement.prefill_replica
            if placement.decode_replica:
                attributes[ta.DECODE_REPLICA] = placement.decode_replica
            span.set_attributes(attributes)
            if route.is_recording():
                route.set_attributes({**attributes, **prediction_attributes(placement)})
        for placement in placements:
            self.metrics.count_decision("disaggregate" if placement.disaggregate else "skip", placement.reason,
                                        prepared.n)
        self.metrics.add_prompt_tokens(prepared.num_prompt_tokens * prepared.n)
        return meta, self._merged(request_id, prepared, placements, span, meta)

    async def _place(self, p: Prepared, prompt_ids: tuple[int, ...], request_id: str) -> Placement:
        """One prompt's placement by the policy over live replica stats (until they arrive, the
        prompt-length rule and Serve's own replica choice). No placement within the SLOs (admission:
        reject) is a 429."""
        self.placer.start()
        request = PlacementRequest(len(prompt_ids), p.params.max_tokens, p.ttft_slo_s, p.tpot_slo_s, p.priority)
        result = await self.queue.place(lambda: self.placer.place(request, prompt_ids, request_id))
        if isinstance(result, Rejection):
            retry = max(1, round(result.retry_after_s))
            raise APIError(429, f"no replica can serve this request within its SLOs ({result.reason}); retry later",
                           code="slo_unattainable", reason=f"slo_{result.reason}",
                           headers={"Retry-After": str(retry)})
        return result

    def _request_attributes(self, p: Prepared, meta: oa.ResponseMeta, request_id: str) -> dict[str, Any]:
        if not self.telemetry.tracing.enabled:
            return {}
        return ta.request_attributes(
            ta.operation_name(p.chat), meta.model, max_tokens=p.params.max_tokens, temperature=p.params.temperature,
            top_p=p.params.top_p, top_k=p.params.top_k, seed=p.params.seed, stream=p.stream, choice_count=p.num_choices,
            request_id=request_id)

    def _reject(self, err: APIError, endpoint: str) -> JSONResponse:
        self._count_rejection(err, endpoint)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    def _count_rejection(self, err: APIError, endpoint: str) -> None:
        self.metrics.count_rejection(err.reason)
        self.api_metrics.requests.labels(endpoint, str(err.status)).inc()
        if err.status in (429, 503):  # turned away for load: a miss in the SLO window
            self.metrics.record_request(ok=False)

    def _enter(self) -> None:
        self.num_inflight += 1
        self.api_metrics.inflight.set(self.num_inflight)

    def _exit(self) -> None:
        self.num_inflight -= 1
        self.api_metrics.inflight.set(self.num_inflight)


def build_app(
    config: RouterConfig | dict[str, Any], prefill_app: Application | None, decode_app: Application,
    kvstore_app: Application | None = None,
) -> Application:
    """The router bound to its prefill (None in colocated mode), decode and kvstore (optional) applications."""
    cfg = config if isinstance(config, RouterConfig) else RouterConfig.model_validate(config)
    if cfg.profile_path and cfg.profile is None:  # read here, in the process that builds the app
        cfg = cfg.model_copy(update={"profile": LatencyProfile.load(cfg.profile_path).to_dict()})
    if cfg.mode == "disaggregated" and prefill_app is None:
        raise ValueError("disaggregated mode needs a prefill application")
    return RouterDeployment.options(
        num_replicas=cfg.num_replicas, ray_actor_options={"num_cpus": cfg.num_cpus},
        # headroom over max_inflight, so the router itself sees the overflow and answers 429 at once
        # instead of Serve's proxy queueing it silently
        max_ongoing_requests=cfg.max_inflight + 32,
    ).bind(cfg.model_dump(), prefill_app if cfg.mode == "disaggregated" else None, decode_app, kvstore_app)
