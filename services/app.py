"""Composition root: the whole system (router, prefill, decode, kvstore) from one validated config."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, GetCoreSchemaHandler, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import CoreSchema, core_schema

from pdserve.services.kvstore.config import KVStoreConfig
from pdserve.services.router.config import RouterConfig
from pdserve.placement.policy import PlacementConfig
from pdserve.services.worker import WorkerConfig, resolve_kv_cache_dtype

if TYPE_CHECKING:
    from ray.serve import Application


class Overrides:
    """A section of partial overrides of `config`, kept as the dict of the keys it sets (merged over the
    system's bases where the section is used). `config` itself validates every key and value as the
    section is read, so a typo is refused with its path: `decode.max_num_seqz`."""

    def __init__(self, config: type[BaseModel]) -> None:
        self.config = config

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        given = core_schema.no_info_plain_validator_function(lambda m: m.model_dump(exclude_unset=True))
        return core_schema.chain_schema([handler.generate_schema(self.config), given])


class RouterSection(RouterConfig):
    """RouterConfig with its `placement` overrides validated as a PlacementConfig."""

    placement: Annotated[dict[str, Any], Overrides(PlacementConfig)] = Field(default_factory=dict)


WorkerOverrides = Annotated[dict[str, Any], Overrides(WorkerConfig)]
RouterOverrides = Annotated[dict[str, Any], Overrides(RouterSection)]
KVStoreOverrides = Annotated[dict[str, Any], Overrides(KVStoreConfig)]


class SystemConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    model: str = "tiny"
    transport: Literal["ucx", "redis"] = "ucx"
    # both roles (None: WorkerConfig.resolved_kv_cache_dtype); a role's own override must agree
    kv_cache_dtype: Literal["auto", "float16", "int8", "fp8_e4m3"] | None = None
    redis_url: str | None = None  # None: no Redis tier (ucx transport only, no kvstore)
    # each section: the keys it overrides, over the bases above (`worker`, `kvstore_config`, `build_system`)
    prefill: WorkerOverrides = Field(default_factory=dict)
    decode: WorkerOverrides = Field(default_factory=dict)
    router: RouterOverrides = Field(default_factory=dict)
    kvstore: KVStoreOverrides = Field(default_factory=dict)
    # OTEL_* variables for every replica (over each process's environment), e.g. an OTLP endpoint
    tracing_env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _roles_share_the_kv_layout(self) -> SystemConfig:
        roles = {role: {**{"kv_cache_dtype": self.kv_cache_dtype}, **getattr(self, role)} for role in ("prefill", "decode")}
        prefill, decode = (resolve_kv_cache_dtype(r["kv_cache_dtype"], r.get("device", "cpu"))
                           for r in (roles["prefill"], roles["decode"]))
        if self.mode == "disaggregated" and prefill != decode:
            raise ValueError(f"prefill and decode KV cache dtypes differ ({prefill} vs {decode}): "
                             "their KV layouts would refuse every handoff")
        return self

    @model_validator(mode="after")
    def _placement_sync_has_a_redis(self) -> SystemConfig:
        if self.router.get("placement_sync") == "redis" and not self.redis_url:
            raise ValueError("router.placement_sync: redis needs the system's redis_url (or auto / none)")
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
                                "kv_cache_dtype": self.kv_cache_dtype,
                                "kv_handoff": self.mode == "disaggregated" or self.transport == "redis"}
        if self.redis_url:
            base["redis_url"] = self.redis_url
        if self.transport == "redis" and not self.redis_url:
            raise ValueError("the redis transport needs redis_url")
        return WorkerConfig.model_validate({**base, **(self.prefill if role == "prefill" else self.decode)})

    def kvstore_config(self) -> KVStoreConfig | None:
        if not self.redis_url:
            return None
        return KVStoreConfig.model_validate({"redis_url": self.redis_url, **self.kvstore})


def config_errors(exc: ValidationError) -> list[str]:
    """One line per error in a SystemConfig, led by the key's path: `decode.max_num_seqz: unknown key`."""
    lines = []
    for error in exc.errors(include_url=False):
        loc = error["loc"]
        if error["type"] == "extra_forbidden":
            near = difflib.get_close_matches(str(loc[-1]), _keys_at(loc[:-1]), n=1)
            message = "unknown key" + (f" (did you mean {near[0]}?)" if near else "")
        else:
            message = error["msg"].removeprefix("Value error, ")
            given = error["input"]
            if not isinstance(given, dict | list) and repr(given) not in message:
                message += f" (got {given!r})"
        path = ".".join(str(part) for part in loc)
        lines.append(f"{path}: {message}" if path else message)
    return lines


def _keys_at(loc: tuple[int | str, ...]) -> list[str]:
    model: type[BaseModel] | None = SystemConfig
    for name in loc:
        field = model.model_fields.get(str(name)) if model is not None else None
        model = _section_model(field) if field is not None else None
    return list(model.model_fields) if model is not None else []


def _section_model(field: FieldInfo) -> type[BaseModel] | None:
    for meta in field.metadata:
        if isinstance(meta, Overrides):
            return meta.config
    for kind in (field.annotation, *get_args(field.annotation)):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None


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
              "tracing_env": config.tracing_env, "redis_url": config.redis_url, **config.router}
    return build_router(router, prefill, decode, kvstore)
