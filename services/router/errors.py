"""OpenAI error objects: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

logger = logging.getLogger(__name__)
INTERNAL_MESSAGE = "internal error; the request id (X-Request-Id) finds it in the server's logs"

_TYPES = {
    400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
    413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 500: "internal_error",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        reason: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.reason = reason or code or str(status)  # label of the rejection counter
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, _TYPES.get(self.status, "invalid_request_error"), self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def from_validation_error(exc: ValidationError) -> APIError:
    first = exc.errors(include_url=False, include_input=False)[0]
    param = ".".join(str(p) for p in first.get("loc", ())) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "value_error":  # a validator's own message, without pydantic's "Value error, "
        message = str(first.get("ctx", {}).get("error") or message)
    if first.get("type") == "unsupported":  # the message names the field already
        return APIError(400, message, param=param, code="unsupported_parameter", reason="unsupported_parameter")
    if param:
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code="invalid_value", reason="invalid_request")


def bad_request(message: str, param: str | None = None, reason: str = "invalid_request") -> APIError:
    return APIError(400, message, param=param, code="invalid_value", reason=reason)


def install_error_handlers(app) -> None:
    """An exception no handler turned into an APIError still answers with an OpenAI error body (a 500 with a
    stable message), not a plain-text traceback page; what it was goes to the log only."""
    from fastapi.responses import JSONResponse

    async def unexpected(request, exc: Exception) -> JSONResponse:
        request_id = getattr(request.state, "request_id", None)
        logger.error("unhandled error in request %s: %s: %s", request_id, type(exc).__name__, exc, exc_info=exc)
        return JSONResponse(error_body(INTERNAL_MESSAGE, "internal_error", code="internal_error"), status_code=500)

    app.add_exception_handler(Exception, unexpected)
