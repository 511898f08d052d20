"""Composition root: the whole system (router, prefill, decode, kvstore) from one validated config."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray.serve import Application

from pdserve.services.kvstore.config import KVStoreConfig
from pdserve.worker import WorkerConfig


class SystemConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    model: str = "tiny"
    transport: Literal["ucx", "redis"] = "ucx"
    kv_cache_dtype: Literal["auto", "int8", "fp8_e4m3"] = "auto"  # both roles; a role's own override must agree
    redis_url: str | None = None  # None: no Redis tier (ucx transport only, no kvstore)
    prefill: dict[str, Any] = Field(default_factory=dict)  # WorkerConfig overrides
    decode: dict[str, Any] = Field(default_factory=dict)
    router: dict[str, Any] = Field(default_factory=dict)  # RouterConfig overrides
    kvstore: dict[str, Any] = Field(default_factory=dict)  # KVStoreConfig overrides
    # OTEL_* variables for every replica (over each process's environment), e.g. an OTLP endpoint
    tracing_env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _roles_share_the_kv_layout(self) -> SystemConfig:
        roles = {role: {**{"kv_cache_dtype": self.kv_cache_dtype}, **getattr(self, role)} for role in ("prefill", "decode")}
        prefill, decode = roles["prefill"]["kv_cache_dtype"], roles["decode"]["kv_cache_dtype"]
        if self.mode == "disaggregated" and prefill != decode:
            raise ValueError(f"prefill and decode KV cache dtypes differ ({prefill} vs {decode}): "
                             "their KV layouts would refuse every handoff")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> SystemConfig:
        import yaml

        with open(path) as f:
            return cls.model_validate(yaml.safe_load(f) or {})

    @property
    def served_model_name(self) -> str:
        """The name clients send as `model`: an alias as given, a checkpoint by its file or folder name."""
        from pdserve.models.resolve import served_model_name

        return served_model_name(self.model)

    def worker(self, role: Literal["prefill", "decode"]) -> WorkerConfig:
        base: dict[str, Any] = {"model": self.model, "transport": self.transport, "tracing_env": self.tracing_env,
                                "kv_cache_dtype": self.kv_cache_dtype}
        if self.redis_url:
            base["redis_url"] = self.redis_url
        if self.transport == "redis" and not self.redis_url:
            raise ValueError("the redis transport needs redis_url")
        return WorkerConfig.model_validate({**base, **(self.prefill if role == "prefill" else self.decode)})

    def kvstore_config(self) -> KVStoreConfig | None:
        if not self.redis_url:
            return None
        return KVStoreConfig.model_validate({"redis_url": self.redis_url, **self.kvstore})


def build_system(config: SystemConfig | dict[str, Any]) -> Application:
    """One app: the router is its only ingress (direct ingress gives each ingress a port of its own), and
    the kvstore, when there is a Redis tier, a deployment inside it."""
    from pdserve.services.decode.app import build_app as build_decode
    from pdserve.services.kvstore.app import build_app as build_kvstore
    from pdserve.services.prefill.app import build_app as build_prefill
    from pdserve.services.router.app import build_app as build_router

    if not isinstance(config, SystemConfig):
        config = SystemConfig.model_validate(config)
    decode = build_decode(config.worker("decode"))
    prefill = build_prefill(config.worker("prefill")) if config.mode == "disaggregated" else None
    kv = config.kvstore_config()
    kvstore = build_kvstore(kv) if kv is not None else None
    router = {"model": config.model, "served_model_name": config.served_model_name, "mode": config.mode,
              "tracing_env": config.tracing_env, **config.router}
    return build_router(router, prefill, decode, kvstore)
