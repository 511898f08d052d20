"""`pdserve plan`: capacity planning from a model config, a device memory size, SLOs and a latency model.

Per replica: KV bytes per token and per request, the KV pool left after the weights, the largest
batch and context it holds, the prefill rate that keeps mean TTFT within the SLO and the decode
throughput at the largest batch whose step time meets the TPOT SLO; then the prefill:decode replica
split for a target request rate and length mix.

A replica of n tensor-parallel ranks takes n devices: its step times and memory follow pdserve.plan_tp.
`--memory`, the weights held and the KV pool are per device (of a decode replica), the tokens it holds per
replica.

Prefill is modelled as an M/D/1 queue (Poisson arrivals, one prompt at a time, service D =
prefill_time(prompt)): mean TTFT = D + ρD / (2(1 - ρ)) <= SLO gives ρ <= 2(SLO - D) / (2·SLO - D)
and a rate of ρ / D per replica. Decode is bounded by the TPOT SLO and by KV memory, not by queueing.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from pdserve.latency_model import DecodeModel, LatencyModel, LatencyProfile, PrefillModel
from pdserve.models.config import ModelConfig, model_config_from_hf
from pdserve.plan_tp import AllReduceCost, rank_config, replicated_config, tensor_parallel_model

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# weight-only quantized linears (pdserve.models.quant_linear), bytes per parameter with groups of 32:
# (held in memory, read by a batch-1 decode step). int4: 4-bit codes + bfloat16 kernel scale and zero per
# group (0.5 + 4/32) read, + float32 exact scale and offset per group (8/32) held for the dequantizing path.
# int8: a GGUF Q8_0's two 4-bit planes (1 + 8/32 read, + 8/32 held); a float checkpoint's per-channel int8
# reads about 1.0. fp8: 1 byte and a per-channel scale (GPU only; not served yet).
# (held, read) bytes per weight under the native CPU kernel (pdserve.kernels.cpu_quant): codes + float16 scale
# and offset per 32, held once and read whole (torch's kernels held int4 0.875 / read 0.625, int8 1.5 / 1.25)
QUANT_WEIGHT_BYTES = {"int4": (0.625, 0.625), "int8": (1.125, 1.125), "fp8": (1.0, 1.0)}
PLAN_QUANTIZATIONS = ("none", *QUANT_WEIGHT_BYTES)
# quantized KV caches: bytes per value, and float16 scale bytes per (token, layer, K/V, KV head)
KV_VALUE_BYTES = {"int8": 1, "fp8_e4m3": 1}
KV_PLAIN_BYTES = {"float16": 2}  # plain values whatever the model dtype, no scales
KV_SCALE_BYTES = 2
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'24GiB', '512 MB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (e.g. 24GiB, 512MB, 1e9)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def load_model_config(source: str) -> ModelConfig:
    """'tiny', an alias or a .gguf file (resolved like any served model), a Hugging Face checkpoint
    directory, or a config.json-style file."""
    from pdserve.models.resolve import MODEL_ALIASES

    if source in MODEL_ALIASES or source.endswith(".gguf"):
        from pdserve.models.resolve import resolve_model_path

        source = str(resolve_model_path(source))
    if source == "tiny":
        from pdserve.models.tiny import TINY_CONFIG

        return model_config_from_hf(TINY_CONFIG)
    path = Path(source).expanduser()
    return model_config_from_hf(json.loads((path / "config.json" if path.is_dir() else path).read_text()))


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """K and V of every layer: 2 · layers · kv_heads · head_dim · dtype bytes; quantized (int8, fp8_e4m3):
    2 · layers · kv_heads · (head_dim · 1 + 2) bytes, a float16 scale per token and KV head included."""
    rows = 2 * config.num_layers * config.num_kv_heads
    if kv_cache_dtype == "auto":
        return rows * config.head_dim * dtype_bytes
    if kv_cache_dtype in KV_PLAIN_BYTES:
        return rows * config.head_dim * KV_PLAIN_BYTES[kv_cache_dtype]
    return rows * (config.head_dim * KV_VALUE_BYTES[kv_cache_dtype] + KV_SCALE_BYTES)


def num_parameters(config: ModelConfig) -> int:
    h, q, kv = config.hidden_size, config.q_size, config.kv_size
    biases = (q + 2 * kv if config.qkv_bias else 0) + (h if config.o_bias else 0)
    attention = h * (q + 2 * kv) + q * h + biases
    mlp = 3 * h * config.intermediate_size + ((2 * config.intermediate_size + h) if config.mlp_bias else 0)
    layer = attention + mlp + 2 * h  # two RMSNorm weights
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return config.num_layers * layer + embeddings + h


def num_packed_parameters(config: ModelConfig) -> int:
    """Weights of the Linear layers (lm_head included, biases not): on CPU with `EngineConfig.pack_weights`
    each also has a oneDNN-blocked copy (pdserve.models.linear), resident beside the plain one."""
    h, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    return config.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * i) + h * config.vocab_size


def weight_bytes(config: ModelConfig, dtype: str, quantization: str = "none",
                 packed_weights: bool = False) -> tuple[int, int]:
    """(bytes the weights hold, bytes a batch-1 decode step reads). The step reads every linear (the LM head
    included, a copy of its own even when tied to the embedding), norms and biases, and one embedding row per
    token (not counted). Quantized: the linears at QUANT_WEIGHT_BYTES (int4 keeps the LM head at 8 bits, as the
    loader does), the rest in `dtype`; a quantized linear is never packed."""
    if quantization not in PLAN_QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {PLAN_QUANTIZATIONS}, got {quantization!r}")
    b = DTYPE_BYTES[dtype]
    embedding = head = config.vocab_size * config.hidden_size
    linears = num_packed_parameters(config) - head  # the decoder layers'
    rest = num_parameters(config) - linears - embedding * (1 if config.tie_word_embeddings else 2)  # norms, biases
    if quantization == "none":
        read = (linears + head + rest) * b
        return read + embedding * b + ((linears + head) * b if packed_weights else 0), read
    held, read = QUANT_WEIGHT_BYTES[quantization]
    head_held, head_read = QUANT_WEIGHT_BYTES["int8" if quantization == "int4" else quantization]
    return (round(linears * held + head * head_held + (rest + embedding) * b),
            round(linears * read + head * head_read + rest * b))


def roofline_model(
    config: ModelConfig, dtype_bytes: int, flops: float, bandwidth: float, kv_cache_dtype: str = "auto",
    read_bytes: int | None = None,
) -> LatencyModel:
    """Latency model with no measurements: compute time from `flops` (FLOP/s), memory time from
    `bandwidth` (bytes/s), added rather than overlapped (a pessimistic roofline).

    prefill: one pass over the streamed weights, 2·P FLOPs per token (P: parameters outside the
    embedding table), causal attention 4·layers·q_size·(n²/2 + n·cached). decode step: one weight
    pass (`read_bytes`: what the served weights read, from `weight_bytes`; None: the streamed parameters at
    `dtype_bytes`), 2·P FLOPs per sequence, and every context token's K/V read once (at the KV cache dtype's
    size).
    """
    kv_bytes = kv_bytes_per_token(config, dtype_bytes, kv_cache_dtype)
    streamed = num_parameters(config) - config.vocab_size * config.hidden_size
    weight_pass = (streamed * dtype_bytes if read_bytes is None else read_bytes) / bandwidth
    per_token = 2 * streamed / flops
    attention = 4 * config.num_layers * config.q_size / flops
    return LatencyModel(
        prefill=PrefillModel(a=weight_pass, b=per_token, c=attention / 2, d=attention),
        decode=DecodeModel(a=weight_pass, b=per_token, c=kv_bytes / bandwidth),
        kv_bytes_per_token=kv_bytes,
    )


@dataclass(frozen=True)
class PlanInput:
    memory_bytes: int  # per device
    ttft_slo_s: float
    tpot_slo_s: float
    rate_rps: float
    prompt_tokens: int  # mean
    output_tokens: int  # mean
    dtype: str = "float32"
    memory_utilization: float = 0.9  # share of the device memory for weights + KV
    block_size: int = 16
    kv_cache_dtype: str = "auto"  # "int8" | "fp8_e4m3": values of 1 byte plus a float16 scale per token and head
    packed_weights: bool = False  # CPU serving with EngineConfig.pack_weights: a second copy of each linear weight
    quantization: str = "none"  # weight-only linears: "int4" | "int8" | "fp8" (QUANT_WEIGHT_BYTES)
    prefill_tensor_parallel_size: int = 1  # ranks (devices) per replica
    decode_tensor_parallel_size: int = 1
    allreduce: AllReduceCost | None = None  # the interconnect, needed where a role has more than one rank


@dataclass(frozen=True)
class Plan:
    latency_source: str  # "profile" | "roofline"
    num_parameters: int
    weight_bytes: int  # held by one device of a decode replica (the driver rank's, the fullest)
    weight_read_bytes: int  # read by one decode step at batch 1
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    kv_pool_bytes: int  # on one device of a decode replica
    max_kv_tokens: int
    max_context_tokens: int
    max_batch_memory: int  # requests of the mean length the pool holds at once
    prefill_s: float  # one mean prompt, alone
    prefill_tokens_s: float
    prefill_rps: float  # per replica, mean TTFT within the SLO (M/D/1)
    decode_batch: int  # largest batch meeting TPOT and memory
    decode_step_s: float
    decode_tokens_s: float
    decode_rps: float
    prefill_replicas: float  # for the target rate, fractional
    decode_replicas: float
    ratio: str  # suggested integer prefill:decode replicas
    prefill_tensor_parallel_size: int
    decode_tensor_parallel_size: int
    prefill_devices: float  # replicas x ranks
    decode_devices: float
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


def plan(
    config: ModelConfig, inp: PlanInput, prefill: LatencyModel, decode: LatencyModel, latency_source: str
) -> Plan:
    dtype_bytes = DTYPE_BYTES[inp.dtype]
    n_p, n_d = inp.prefill_tensor_parallel_size, inp.decode_tensor_parallel_size
    if min(n_p, n_d) < 1:
        raise ValueError("a tensor-parallel size must be >= 1")
    if max(n_p, n_d) > 1:
        if inp.allreduce is None:
            raise ValueError("more than one rank per replica needs the all-reduce cost "
                             "(--allreduce-latency-us and --allreduce-bandwidth)")
        prefill = tensor_parallel_model(prefill, config, n_p, dtype_bytes, inp.allreduce)
        decode = tensor_parallel_model(decode, config, n_d, dtype_bytes, inp.allreduce)
    params = num_parameters(config)
    weights, read = weight_bytes(config, inp.dtype, inp.quantization, inp.packed_weights)
    everywhere = (weight_bytes(replicated_config(config), inp.dtype, inp.quantization, inp.packed_weights)[0]
                  + 2 * config.num_layers * config.hidden_size * dtype_bytes)  # + every layer's two norms
    per_token = kv_bytes_per_token(config, dtype_bytes, inp.kv_cache_dtype)
    length = inp.prompt_tokens + inp.output_tokens
    # per device of a decode replica (the driver's: the LM head too): its share of the split weights, the
    # replicated ones, and a pool of blocks holding its KV heads
    device_weights = math.ceil((weights - everywhere) / n_d) + everywhere
    device_pool = max(0, int(inp.memory_bytes * inp.memory_utilization) - device_weights)
    block_bytes = kv_bytes_per_token(rank_config(config, n_d), dtype_bytes, inp.kv_cache_dtype) * inp.block_size
    max_tokens = device_pool // block_bytes * inp.block_size
    per_request_tokens = math.ceil(length / inp.block_size) * inp.block_size
    max_batch_memory = max_tokens // per_request_tokens
    notes = []
    if max_batch_memory == 0:
        notes.append("the KV pool cannot hold one request of the mean length")

    prefill_s = prefill.prefill_time_s(inp.prompt_tokens)
    if prefill_s < inp.ttft_slo_s:
        rho = 2 * (inp.ttft_slo_s - prefill_s) / (2 * inp.ttft_slo_s - prefill_s)
        prefill_rps = rho / prefill_s
    else:
        prefill_rps = 0.0
        notes.append("one mean prompt alone misses the TTFT SLO")

    context = inp.prompt_tokens + inp.output_tokens // 2  # a sequence's mean context over its decode
    batch = 0
    for b in range(1, max_batch_memory + 1):
        if decode.decode_step_s(b, b * context) > inp.tpot_slo_s:
            break
        batch = b
    if batch == 0 and max_batch_memory:
        notes.append("a batch of one misses the TPOT SLO")
    step = decode.decode_step_s(batch, batch * context) if batch else 0.0
    decode_tokens_s = batch / step if batch else 0.0
    decode_rps = decode_tokens_s / inp.output_tokens

    need_p = inp.rate_rps / prefill_rps if prefill_rps else math.inf
    need_d = inp.rate_rps / decode_rps if decode_rps else math.inf
    ratio = f"{math.ceil(need_p)}:{math.ceil(need_d)}" if math.isfinite(need_p + need_d) else "infeasible"
    return Plan(
        latency_source=latency_source, num_parameters=params, weight_bytes=device_weights,
        weight_read_bytes=read, kv_bytes_per_token=per_token,
        kv_bytes_per_request=per_token * length, kv_pool_bytes=device_pool, max_kv_tokens=max_tokens,
        max_context_tokens=min(max_tokens, config.max_position_embeddings), max_batch_memory=max_batch_memory,
        prefill_s=prefill_s, prefill_tokens_s=inp.prompt_tokens / prefill_s if prefill_s else 0.0,
        prefill_rps=prefill_rps, decode_batch=batch, decode_step_s=step, decode_tokens_s=decode_tokens_s,
        decode_rps=decode_rps, prefill_replicas=need_p, decode_replicas=need_d, ratio=ratio,
        prefill_tensor_parallel_size=n_p, decode_tensor_parallel_size=n_d,
        prefill_devices=need_p * n_p, decode_devices=need_d * n_d, notes=tuple(notes),
    )


def latency_model_for(args_profile: str | None, role: str, config: ModelConfig, dtype: str,
                      flops: float | None, bandwidth: float | None,
                      kv_cache_dtype: str = "auto", quantization: str = "none") -> tuple[LatencyModel, str]:
    """A profiled model carries its measured fits; with a quantized `kv_cache_dtype` its KV size per token
    (the handoff transfer term) becomes the quantized one, while its decode fit stays as measured."""
    if args_profile:
        model = LatencyProfile.load(args_profile).for_role(role)
        if kv_cache_dtype != "auto":
            model = replace(model, kv_bytes_per_token=kv_bytes_per_token(config, DTYPE_BYTES[dtype], kv_cache_dtype))
        return model, "profile"
    if not flops or not bandwidth:
        raise ValueError("without --profile, pass --flops and --bandwidth for a roofline estimate")
    read = weight_bytes(config, dtype, quantization)[1]
    return roofline_model(config, DTYPE_BYTES[dtype], flops, bandwidth, kv_cache_dtype, read), "roofline"


def render(p: Plan, inp: PlanInput) -> str:
    gib = 2**30
    device = " per device" if p.decode_tensor_parallel_size > 1 else ""
    lines = [
        f"latency model: {p.latency_source}",
        f"parameters {p.num_parameters / 1e6:.1f}M, weights {p.weight_bytes / gib:.2f} GiB{device} ({inp.dtype}"
        f"{f', linears {inp.quantization}' if inp.quantization != 'none' else ''}"
        f"{', linears packed twice' if inp.packed_weights and inp.quantization == 'none' else ''}), "
        f"{p.weight_read_bytes / 2**20:.1f} MiB read per decode step",
        f"KV per token {p.kv_bytes_per_token} B ({inp.kv_cache_dtype}), per request "
        f"({inp.prompt_tokens}+{inp.output_tokens} tokens) "
        f"{p.kv_bytes_per_request / 2**20:.2f} MiB",
        f"KV pool {p.kv_pool_bytes / gib:.2f} GiB{device}: {p.max_kv_tokens} tokens, "
        f"max context {p.max_context_tokens}, "
        f"max batch {p.max_batch_memory} at the mean length",
        f"prefill per replica: {p.prefill_s * 1e3:.1f} ms per mean prompt, {p.prefill_tokens_s:.0f} tok/s, "
        f"{p.prefill_rps:.2f} req/s within TTFT {inp.ttft_slo_s * 1e3:.0f} ms",
        f"decode per replica: batch {p.decode_batch} at {p.decode_step_s * 1e3:.1f} ms/step "
        f"(TPOT {inp.tpot_slo_s * 1e3:.0f} ms), {p.decode_tokens_s:.0f} tok/s, {p.decode_rps:.2f} req/s",
        f"for {inp.rate_rps:g} req/s: {p.prefill_replicas:.2f} prefill + "
        f"{p.decode_replicas:.2f} decode replicas "
        f"-> prefill:decode = {p.ratio}",
    ]
    if max(p.prefill_tensor_parallel_size, p.decode_tensor_parallel_size) > 1:
        lines.append(f"tensor parallel: {p.prefill_tensor_parallel_size} ranks per prefill replica, "
                     f"{p.decode_tensor_parallel_size} per decode replica: {p.prefill_devices:.2f} + "
                     f"{p.decode_devices:.2f} devices")
    return "\n".join(lines + [f"note: {n}" for n in p.notes])
