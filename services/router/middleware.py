"""The router's ASGI middleware: request ids, and the name of the router replica that answered."""

from __future__ import annotations

import uuid

from pdserve.observability.telemetry import replica_name

REQUEST_ID_HEADER = "x-request-id"
ROUTER_HEADER = "x-pdserve-router"  # the router replica that answered: which streams a lost router took with it


class RequestIdMiddleware:
    """Pure ASGI (streams pass through untouched): the request id is X-Request-Id or a fresh one.

    The Serve proxy already honours X-Request-Id (generating one when absent, so replicas always see
    it) and echoes it on the response; echoing here as well would send the header twice. Every response
    names the router replica that answered (X-Pdserve-Router).
    """

    def __init__(self, app) -> None:
        self.app = app
        self._router: tuple[bytes, bytes] | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or ()).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given[:128] if given and given.isprintable() else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        if self._router is None:
            self._router = (ROUTER_HEADER.encode(), replica_name("router").encode())

        async def send_with_router(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._router]}
            await send(message)

        await self.app(scope, receive, send_with_router)
