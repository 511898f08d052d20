"""What `pdserve serve` puts in the environment of the process that starts Ray (and so of every Ray worker)."""

from __future__ import annotations

from pdserve.runtime.serve_env import BASE_ENV, serve_env


def test_two_malloc_arenas_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    env = serve_env("direct", 8000, 9000)
    assert env["MALLOC_ARENA_MAX"] == "2"
    assert BASE_ENV.items() <= env.items()
    monkeypatch.setenv("MALLOC_ARENA_MAX", "8")
    assert serve_env("proxy", 8000, None)["MALLOC_ARENA_MAX"] == "8"
