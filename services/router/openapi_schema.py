"""The OpenAPI document: the completions endpoints read raw JSON (to bound the body before parsing), so
FastAPI cannot see their request models; this attaches them, so /docs and schema-driven clients do."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pdserve.api.protocol import ChatCompletionRequest, CompletionRequest

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}
REF = "#/components/schemas/{model}"
ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


# what the GET endpoints answer besides their 200 JSON (FastAPI cannot see it: they build their responses)
GET_RESPONSES: dict[str, dict[str, str]] = {
    "/health": {"503": "a role has no live replica; retry later"},
    "/v1/models": {"401": "missing or wrong API key"},
}
TEXT = {"schema": {"type": "string"}}
# a stream's schema describes each server-sent event: its data is a JSON chunk, or [DONE] at the end
EVENTS = {"schema": {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}}


def openapi_document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="OpenAI-compatible completions and chat completions (pdserve router)")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["ErrorResponse"] = ERROR_SCHEMA
    error = {"content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}}
    paths = doc.get("paths", {})
    for path, statuses in GET_RESPONSES.items():
        if (operation := paths.get(path, {}).get("get")) is not None:
            operation.setdefault("responses", {}).update(
                {status: {"description": text, **error} for status, text in statuses.items()})
    if (operation := paths.get("/metrics", {}).get("get")) is not None:
        operation["responses"] = {"200": {"description": "Prometheus text exposition",
                                          "content": {"text/plain": TEXT}}}
    for path, model in REQUEST_MODELS.items():
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        operation = paths.get(path, {}).get("post")
        if operation is None:
            continue
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
        operation.setdefault("responses", {}).update({"200": {
            "description": "the response object; with stream: true, server-sent chunks ending with data: [DONE]",
            "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": EVENTS}}})
        operation["responses"].update({
            str(status): {"description": text, **error}
            for status, text in ((400, "invalid request"), (401, "missing or wrong API key"),
                                 (404, "unknown model"), (413, "body too large"), (429, "too many requests"),
                                 (503, "no capacity; retry later"))})
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serves the document above (built once, on first request) at the app's openapi_url."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = openapi
