"""Client-facing errors: an exception nothing expected still answers with an OpenAI error body whose message
names no internals, and the exception itself goes to the log."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pdserve.services.router.errors import INTERNAL_MESSAGE, install_error_handlers


@pytest.fixture
def client():
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("The actor is dead: ActorID(0123abcd), pid=4242, ip=10.1.2.3")

    return TestClient(app, raise_server_exceptions=False)


def test_an_unexpected_exception_is_a_clean_openai_500(client, caplog):
    with caplog.at_level(logging.ERROR, logger="pdserve.services.router.errors"):
        resp = client.get("/boom")
    assert resp.status_code == 500 and resp.headers["content-type"] == "application/json"
    assert resp.json() == {"error": {"message": INTERNAL_MESSAGE, "type": "internal_error", "param": None,
                                     "code": "internal_error"}}
    assert "ActorID(0123abcd)" in caplog.text and "pid=4242" in caplog.text  # the log keeps what it was
