"""What prefill and decode workers share: their validated config and how they build engine and transport."""

from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pdserve.services.autoscaling import RoleAutoscaling

if TYPE_CHECKING:  # the config validates without torch (`pdserve serve` refuses a bad file before any import)
    from pdserve.config import EngineConfig, SpeculativeConfig
    from pdserve.engine.async_engine import AsyncLLMEngine
    from pdserve.kvcache.transports import KVTransport

UCX_HOST_ENV = "PDSERVE_UCX_HOST"


class SpeculativeSettings(BaseModel):
    """Speculative decoding for a role's engine (pdserve.config.SpeculativeConfig); set it on decode."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = Field(8, ge=1, le=32)
    prompt_lookup_min: int = Field(3, ge=1)
    prompt_lookup_max: int = Field(4, ge=1)
    disable_by_batch_size: int | None = Field(None, ge=1)

    def engine_config(self) -> SpeculativeConfig:
        from pdserve.config import SpeculativeConfig

        return SpeculativeConfig(**self.model_dump())


def resolve_kv_cache_dtype(kv_cache_dtype: str | None, device: str) -> str:
    """As set, else float16 on CPU (half the bytes of a float32 model's cache that each decode step reads
    and each handoff moves, llama.cpp's default cache type too; and the same layout whichever activation
    dtype a role resolves to) and auto (the model dtype) elsewhere."""
    if kv_cache_dtype is not None:
        return kv_cache_dtype
    return "float16" if device.startswith("cpu") else "auto"


# A CPU step of 128 prompt rows already runs the linears at a core's full rate, so a larger budget only holds
# every prompt of the step until the last is done: at c = 16 (`pdserve bench peer`, 2 cores) the prefill
# replica took a burst of 16 prompts as one 2,048-token step while decode idled; 512 let each step's four
# hand off and decode alongside (output 129 -> 173 tok/s; 256: 168)
CPU_MAX_NUM_BATCHED_TOKENS = 512


class WorkerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = "tiny"
    device: str = "cpu"
    # None: float32 on CPU (bfloat16 on CUDA); "auto": bfloat16 where the CPU has AVX-512 BF16 or AMX-BF16
    # (or on CUDA), float32 elsewhere (pdserve.cpu_caps)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    # weight-only linears (pdserve.models.quant_load): auto (a GGUF's Q4_x / Q8_0 tensors as stored, float
    # checkpoints in their dtype; tensor-parallel ranks in the model dtype) | none (the model dtype) | int8 |
    # int4 | fp8 (needs a GPU with FP8)
    quantization: Literal["none", "auto", "int8", "int4", "fp8"] = "auto"
    # ranks of one replica splitting every layer (pdserve.models.tensor_parallel): the replica's process and
    # tensor_parallel_size - 1 more, each with num_cpus threads. CPU (gloo) and unquantized weights only
    # (quantization auto serves the model dtype there)
    tensor_parallel_size: int = Field(1, ge=1)
    block_size: int = Field(16, ge=1)
    # 128 MiB: 5.8k tokens of SmolLM2-135M's KV in the CPU default float16 cache (11.6k in int8, 2.9k in float32)
    kv_memory_bytes: int = Field(128 << 20, ge=1 << 20)
    num_blocks: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    # per-step token budget, the prefill chunk size; None: CPU_MAX_NUM_BATCHED_TOKENS on CPU, 2048 elsewhere
    max_num_batched_tokens: int | None = Field(None, ge=1)
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # KV pool values: auto (the model dtype), float16 (CPU), or int8 / fp8 e4m3 with per-(token, KV head)
    # scales (a quarter of float32's bytes per block and per handoff); None: float16 on CPU, else auto
    # (`resolve_kv_cache_dtype`). Prefill and decode must agree (SystemConfig checks), or
    # every handoff falls back
    kv_cache_dtype: Literal["auto", "float16", "int8", "fp8_e4m3"] | None = None
    lease_ttl_s: float = Field(30.0, gt=0)
    transport: Literal["ucx", "redis"] = "ucx"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # the address the UCX listener binds and advertises in handoff params; None: $PDSERVE_UCX_HOST (the
    # Helm chart sets it to the pod IP), else loopback
    ucx_host: str | None = None
    # off: CMA on one host (~2x faster here), but a peer dying mid-transfer aborts this process (UCXConfig)
    ucx_endpoint_error_handling: bool = True
    # ucx transport: a decode replica on the prefill replica's node (same kernel, network namespace and user)
    # pulls through shared memory instead (pdserve.kvcache.transports.shm); off: always UCX
    kv_same_host: bool = True
    # false: no KV moves in or out of this replica (a colocated app without the Redis tier), so a
    # tensor-parallel one keeps no whole-model pool for handoffs (pdserve.engine.tp_kv)
    kv_handoff: bool = True
    num_replicas: int = Field(1, ge=1)
    # Ray CPUs per rank and its torch thread count: a replica asks Ray for num_cpus x tensor_parallel_size
    num_cpus: float = Field(1.0, ge=0)
    label_selector: dict[str, str] = Field(default_factory=dict)  # node labels (compute- vs bandwidth-optimized)
    # Serve-level bounds: calls a replica runs at once (Serve's own default is 5, too few to batch), and
    # calls waiting at the caller's handle beyond that; past it the router answers 503 with Retry-After.
    max_ongoing_requests: int = Field(128, ge=1)
    max_queued_requests: int = Field(512, ge=1)
    # OTEL_* variables for this replica's tracing, over its process environment (which Ray may not pass on)
    tracing_env: dict[str, str] = Field(default_factory=dict)
    # decode streams: deltas queued while the router was away go as one message (the first at once);
    # stream_interval_ms > 0 caps messages at one per interval
    stream_coalesce: bool = True
    stream_interval_ms: float = Field(0.0, ge=0, le=10_000)
    # extra environment of this role's replica processes (e.g. Ray Serve settings); {}: what Ray was started with
    serve_env: dict[str, str] = Field(default_factory=dict)
    # n-gram speculative decoding in this role's engine (decode); None: off
    speculative: SpeculativeSettings | None = None
    # opt-in SLO-driven autoscaling of this role's replicas (pdserve.services.autoscaling); None: num_replicas, held
    autoscaling: RoleAutoscaling | None = None

    @model_validator(mode="after")
    def _autoscaling_targets_can_be_met(self) -> WorkerConfig:
        if self.autoscaling is not None:
            self.autoscaling.check_profile(self.block_size)
        return self

    @field_validator("quantization")
    @classmethod
    def _fp8_needs_a_gpu(cls, value: str, info: ValidationInfo) -> str:
        device = info.data.get("device", "cpu")
        if value == "fp8" and not device.startswith("cuda"):
            raise ValueError(f"fp8 weights need a GPU with FP8; device {device!r} has none (int8 or int4 run on CPU)")
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _float16_cache_on_cpu(cls, value: str | None, info: ValidationInfo) -> str | None:
        device = info.data.get("device", "cpu")
        if value == "float16" and not device.startswith("cpu"):
            raise ValueError(f"float16 is the CPU's half-size cache; on device {device!r} use auto (the model "
                             "dtype), int8 or fp8_e4m3")
        return value

    @field_validator("tensor_parallel_size")
    @classmethod
    def _tensor_parallel_runs_on_cpu(cls, value: int, info: ValidationInfo) -> int:
        device, quantization = info.data.get("device", "cpu"), info.data.get("quantization", "none")
        if value > 1 and not device.startswith("cpu"):
            raise ValueError(f"above 1 the ranks run on CPU over gloo only; device {device!r} would need "
                             "NCCL, which is not wired yet")
        if value > 1 and quantization not in ("none", "auto"):
            raise ValueError(f"above 1 the ranks serve unquantized weights only, not quantization "
                             f"{quantization!r} (quantized linears would need block-aligned shards)")
        return value

    def resolved_ucx_host(self) -> str:
        return self.ucx_host or os.environ.get(UCX_HOST_ENV) or "127.0.0.1"

    def resolved_kv_cache_dtype(self) -> str:
        return resolve_kv_cache_dtype(self.kv_cache_dtype, self.device)

    def resolved_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CPU_MAX_NUM_BATCHED_TOKENS if self.device.startswith("cpu") else 2048

    def engine_config(self) -> EngineConfig:
        from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig

        return EngineConfig(
            model=self.model, device=self.device, dtype=self.dtype, quantization=self.quantization,
            lease_ttl_s=self.lease_ttl_s, tensor_parallel_size=self.tensor_parallel_size,
            num_threads=max(1, int(self.num_cpus)),
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_blocks,
                              memory_budget_bytes=self.kv_memory_bytes,
                              enable_prefix_caching=self.enable_prefix_caching,
                              kv_cache_dtype=self.resolved_kv_cache_dtype()),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.resolved_max_num_batched_tokens(),
                                      enable_chunked_prefill=self.enable_chunked_prefill),
            speculative=None if self.speculative is None else self.speculative.engine_config(),
        )

    def actor_options(self) -> dict[str, Any]:
        """Ray options of a replica: its ranks are processes on the replica's node, one CPU share each."""
        options: dict[str, Any] = {"num_cpus": round(self.num_cpus * self.tensor_parallel_size, 4)}
        if self.serve_env:
            options["runtime_env"] = {"env_vars": dict(self.serve_env)}
        if self.label_selector:
            options["label_selector"] = dict(self.label_selector)
        return options

    def deployment_options(self, request_router_class: str | None = None) -> dict[str, Any]:
        """Serve deployment options; `request_router_class` routes each call to the replica it names."""
        options: dict[str, Any] = {
            "num_replicas": self.num_replicas, "ray_actor_options": self.actor_options(),
            "max_ongoing_requests": self.max_ongoing_requests, "max_queued_requests": self.max_queued_requests,
        }
        scaling = self.autoscaling
        if scaling is not None and scaling.policy != "static":
            del options["num_replicas"]
            options["autoscaling_config"] = scaling.serve_autoscaling_config(self.num_replicas, self.transport)
            options["graceful_shutdown_timeout_s"] = scaling.graceful_shutdown_timeout_s
        if request_router_class is not None:
            from ray.serve.config import RequestRouterConfig

            options["request_router_config"] = RequestRouterConfig(request_router_class=request_router_class)
        return options


def start_engine(config: WorkerConfig, role: str) -> AsyncLLMEngine:
    """The role's engine, and one line on stdout (Ray relays it to the driver: `pdserve serve`'s output)
    naming the weights and activations it serves."""
    from pdserve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_config(config.engine_config())
    engine.on_broken = functools.partial(_exit_broken, role)
    print(f"{role} replica: {engine.engine.served_weights}", flush=True)
    return engine


def _exit_broken(role: str, exc: BaseException) -> None:
    """A replica whose engine cannot step again (a tensor-parallel rank lost) exits at once, as if killed:
    Serve replaces it, and the router moves its streams to a live replica as from any dead one. Failing the
    streams instead would end them with an error."""
    print(f"{role} replica: {exc}; exiting so that the replica is replaced and its streams move",
          file=sys.stderr, flush=True)
    os._exit(1)


def build_transport(config: WorkerConfig, engine: AsyncLLMEngine) -> KVTransport:
    from pdserve.engine.handoff import engine_layout, engine_pool
    from pdserve.kvcache.pool import KVPoolIO
    from pdserve.kvcache.transports import create_transport
    from pdserve.kvcache.transports.ucx_env import UCXConfig

    release = engine.release_lease_quietly
    if config.tensor_parallel_size > 1 and not config.kv_handoff:
        from pdserve.services.no_handoff import NoHandoff

        return NoHandoff(KVPoolIO(engine.engine.runner.kv_pool), engine_layout(engine), release)
    pool, layout = engine_pool(engine), engine_layout(engine)
    if config.transport == "redis":
        return create_transport("redis", pool, layout, release, url=config.redis_url, ttl_s=int(config.lease_ttl_s) * 20)
    ucx = UCXConfig.for_pool(pool, endpoint_error_handling=config.ucx_endpoint_error_handling)
    if not config.kv_same_host:
        return create_transport("ucx", pool, layout, release, host=config.resolved_ucx_host(), config=ucx)
    from pdserve.kvcache.transports.same_host import SameHostFirst
    from pdserve.kvcache.transports.shm import ShmConfig

    remote = create_transport("ucx", pool, layout, host=config.resolved_ucx_host(), config=ucx)
    local = create_transport("shm", pool, layout, config=ShmConfig())
    return SameHostFirst(pool, layout, release, remote=remote, local=local)
