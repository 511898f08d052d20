"""Serve application builders for a Serve config file (`import_path` + `args`), as KubeRay's
serveConfigV2 and `serve deploy` use them. `args` are SystemConfig fields; the Helm chart renders them.

`${PDSERVE_...}` in `redis_url` is filled from the environment of the process that builds the app
(a Ray pod, where the chart sets PDSERVE_REDIS_PASSWORD from a Secret), so no password is written
into the RayService object.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import quote

from ray.serve import Application

from pdserve.services.app import SystemConfig, build_system

_ENV_REF = re.compile(r"\$\{(PDSERVE_[A-Z0-9_]+)\}")


def expand_env(value: str, environ: dict[str, str] | None = None) -> str:
    """`${PDSERVE_NAME}` -> the variable's value, percent-quoted for a URL; an unset variable is an error."""
    env = os.environ if environ is None else environ

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise ValueError(f"{name} is referenced in the config but not set in this environment")
        return quote(env[name], safe="")

    return _ENV_REF.sub(sub, value)


def system_config(args: dict[str, Any], environ: dict[str, str] | None = None) -> SystemConfig:
    config = SystemConfig.model_validate(args)
    if config.redis_url:
        config = config.model_copy(update={"redis_url": expand_env(config.redis_url, environ)})
    return config


def build_pdserve(args: dict[str, Any]) -> Application:
    """The router with its prefill and decode deployments (`build_system`)."""
    return build_system(system_config(args))


def build_kvstore(args: dict[str, Any]) -> Application:
    """The kvstore over the config's Redis; the same `args` as build_pdserve."""
    from pdserve.services.kvstore.app import build_app

    kv = system_config(args).kvstore_config()
    if kv is None:
        raise ValueError("the kvstore application needs redis_url")
    return build_app(kv)
