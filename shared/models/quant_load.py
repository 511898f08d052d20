"""Which layers of a loaded model are served quantized, and building them.

On CUDA the linears are pdserve.models.quant_linear_cuda's (Triton int4/int8, FP8 via _scaled_mm);
quantization "fp8" is served there only, on FP8 hardware, every Linear but the LM head from float weights.

GGUF-converted directories carry the file's Q4_0 / Q4_1 / Q8_0 blocks (pdserve.models.gguf.QUANTIZED_FILE):
linears taken from blocks are built from them before the float weights load, and their float32 copies
are never read. Float-sourced linears (HF checkpoints) load as usual and are then rounded to nearest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pdserve.kernels import cpu_quant
from pdserve.models import packed_cache
from pdserve.models.config import ModelConfig
from pdserve.models.gguf import QUANTIZED_FILE
from pdserve.models.linear import Linear
from pdserve.models.quant_linear import QuantEmbedding, QuantLinear
from pdserve.models.quant_linear_cuda import CudaQuantLinear, quant_linear_for
from pdserve.models.quant_linear_native import NativeQuantLinear, TiedQuantEmbedding
from pdserve.models.quantization import (
    GROUP_SIZE,
    QuantizedWeight,
    check_group,
    concat,
    from_gguf_blocks,
    quantize_rtn,
    quantize_rtn_symmetric,
    target_bits,
)

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EMBEDDING = "model.embed_tokens.weight"


def linear_sources(module_name: str, config: ModelConfig) -> list[str]:
    """HF tensor names a Linear of LlamaForCausalLM is made of, in its output order."""
    if module_name == "lm_head":
        return [EMBEDDING if config.tie_word_embeddings else "lm_head.weight"]
    parent, _, leaf = module_name.rpartition(".")
    return [f"model.{parent}.{part}.weight" for part in FUSED.get(leaf, (leaf,))]


def read_block_types(model_dir: Path) -> dict[str, str]:
    """HF name -> GGUF block type of the tensors kept as stored; empty for an HF checkpoint."""
    path = model_dir / QUANTIZED_FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata() or {})
    meta.pop("format", None)
    return meta


@dataclass(frozen=True)
class QuantPlan:
    mode: str
    from_blocks: dict[str, int] = field(default_factory=dict)  # Linear name -> bits, built from GGUF blocks
    from_float: dict[str, int] = field(
        default_factory=dict
    )  # Linear name -> bits, rounded to nearest at load
    block_types: dict[str, str] = field(default_factory=dict)
    sources: dict[str, list[str]] = field(default_factory=dict)
    embedding_from_blocks: bool = False

    @property
    def skipped_float_weights(self) -> set[str]:
        """HF names whose float32 copies are not loaded."""
        names = {n for m in self.from_blocks for n in self.sources[m]}
        return names | ({EMBEDDING} if self.embedding_from_blocks else set())

    def describe(self) -> str:
        """One line for the start-up log: what `mode` chose, per kernel and source."""
        if not self.from_blocks and not self.from_float:
            return f"quantization={self.mode}: weights in the model dtype"
        counts: dict[str, int] = {}
        for plan, how in ((self.from_blocks, "GGUF blocks"), (self.from_float, "round-to-nearest")):
            for name, bits in plan.items():
                types = "/".join(sorted({self.block_types.get(s, "float") for s in self.sources[name]}))
                key = f"{'fp8' if self.mode == 'fp8' else f'int{bits}'} from {how} ({types})"
                counts[key] = counts.get(key, 0) + 1
        parts = ", ".join(f"{n} linears {k}" for k, n in sorted(counts.items()))
        embedding = (
            "embedding from Q8_0/Q4 blocks" if self.embedding_from_blocks else "embedding in the model dtype"
        )
        return f"quantization={self.mode}: {parts}; {embedding}"


def plan_quantization(
    model: nn.Module, config: ModelConfig, model_dir: Path, mode: str, device: torch.device | str | None = None
) -> QuantPlan:
    """Decide each Linear's format; refuses (ValueError, naming the tensor) what cannot be served.
    device: where the model is served (default: where its parameters are)."""
    if device is None:
        device = next(model.parameters(), torch.empty(0)).device
    if mode == "fp8" and torch.device(device).type == "cuda":
        return _plan_fp8(model, config, device)
    target_bits(mode, "F32")  # refuses an unknown mode, and fp8 on CPU
    if mode == "none":
        return QuantPlan(mode)
    block_types = read_block_types(model_dir)
    from_blocks, from_float, sources = {}, {}, {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        names = sources[name] = linear_sources(name, config)
        types = [block_types.get(n, "F32") for n in names]
        bits = [target_bits(mode, t, is_lm_head=name == "lm_head") for t in types]
        if all(b is None for b in bits):
            continue
        if all(n in block_types for n in names):
            from_blocks[name] = max(b for b in bits if b is not None)  # mixed 4/8-bit parts widen to 8
        elif mode == "auto":
            continue  # float parts fused with block parts: served as float, as `auto` serves floats
        else:
            from_float[name] = bits[0]
            if bits[0] == 4:
                check_group(names[0], module.in_features, GROUP_SIZE)
    embedding = mode != "none" and EMBEDDING in block_types
    return QuantPlan(mode, from_blocks, from_float, block_types, sources, embedding)


def _plan_fp8(model: nn.Module, config: ModelConfig, device: torch.device | str) -> QuantPlan:
    from pdserve.kernels.fp8_matmul import fp8_refusal

    if (reason := fp8_refusal(device)) is not None:
        raise ValueError(f"quantization 'fp8': {reason}")
    sources = {
        name: linear_sources(name, config)
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name != "lm_head"
    }
    return QuantPlan("fp8", from_float=dict.fromkeys(sources, 8), sources=sources)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def apply_blocks(model: nn.Module, model_dir: Path, plan: QuantPlan, dtype: torch.dtype) -> None:
    """Replace the block-sourced Linears (and the embedding) before the float weights load."""
    if not plan.from_blocks and not plan.embedding_from_blocks:
        return
    device = next(model.parameters()).device
    # on CPU with the native kernel: the packed linears of an earlier load, mapped (pdserve.models.packed_cache)
    key = (packed_cache.source_key(model_dir, plan.mode, plan.from_blocks)
           if device.type == "cpu" and cpu_quant.library() is not None and plan.from_blocks else None)
    cached = (packed_cache.load(model_dir, key) if key else None) or {}
    with safe_open(str(model_dir / QUANTIZED_FILE), framework="np") as f:

        def weight(hf_name: str) -> QuantizedWeight:
            return from_gguf_blocks(f.get_tensor(hf_name), plan.block_types[hf_name], hf_name)

        for name, bits in plan.from_blocks.items():
            linear = model.get_submodule(name)
            if name in cached and linear.bias is None:
                _set_module(model, name, cached[name])
                continue
            parts = [weight(n) for n in plan.sources[name]]
            fused = concat([p.widened() if bits == 8 else p for p in parts])
            if bits == 4 and fused.bits == 8:  # int4 asked of a Q8_0 tensor: round to nearest, group 32
                fused = quantize_rtn(fused.dequantize(), 4, GROUP_SIZE, plan.sources[name][0])
            source = plan.sources[name][0]
            _set_module(model, name, quant_linear_for(fused, linear.bias, source, linear.weight.device))
        if key and not cached:
            packed_cache.save(model_dir, key, {
                name: module for name in plan.from_blocks
                if isinstance(module := model.get_submodule(name), NativeQuantLinear) and module.bias is None})
        if plan.embedding_from_blocks:
            head = model.get_submodule("lm_head")
            if plan.sources.get("lm_head") == [EMBEDDING] and isinstance(head, NativeQuantLinear) and head.bits == 8:
                _set_module(model, "embed_tokens", TiedQuantEmbedding(head, dtype))  # one copy of the table
                return
            _set_module(model, "embed_tokens", QuantEmbedding(weight(EMBEDDING), dtype).to(device))


def apply_float(model: nn.Module, plan: QuantPlan) -> None:
    """Round the float-sourced Linears to nearest, once their float weights are loaded."""
    for name, bits in plan.from_float.items():
        linear = model.get_submodule(name)
        weight = linear.weight.detach().t()  # ours [in, out] -> [out, in]
        source = plan.sources[name][0]
        if plan.mode == "fp8":
            _set_module(model, name, CudaQuantLinear.from_float_fp8(weight, linear.bias, weight.device))
            continue
        q = (
            quantize_rtn(weight, 4, GROUP_SIZE, source)
            if bits == 4
            else quantize_rtn_symmetric(weight, source)
        )
        _set_module(model, name, quant_linear_for(q, linear.bias, source, weight.device))


def quantized_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by quantized modules and by the float parameters left."""
    quant = sum(
        m.nbytes() for m in model.modules() if isinstance(m, (QuantLinear, NativeQuantLinear, CudaQuantLinear))
    )
    held = {b.data_ptr() for m in model.modules() if not isinstance(m, QuantEmbedding) for b in m.buffers()}
    quant += sum(  # a tied embedding's buffers are the LM head's, counted once
        b.numel() * b.element_size()
        for m in model.modules()
        if isinstance(m, QuantEmbedding)
        for b in m.buffers(recurse=False)
        if b.data_ptr() not in held
    )
    floats = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"quantized_bytes": quant, "float_bytes": floats}

