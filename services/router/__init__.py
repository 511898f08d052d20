"""Router: OpenAI-compatible HTTP ingress that places each request on prefill + decode (or decode only).

Public API: `RouterConfig`, `RouterDeployment`, `build_app`. Importing it never imports torch.
"""

from pdserve.services.router.config import RouterConfig

__all__ = ["RouterConfig", "RouterDeployment", "build_app"]


def __getattr__(name: str):
    # app.py imports ray.serve and fastapi: only on demand
    if name in ("RouterDeployment", "build_app"):
        from pdserve.services.router import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
