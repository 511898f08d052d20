"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2) over a packed token batch and a paged KV cache.

Projections are fused (qkv, gate_up); `load_weights` maps Hugging Face names onto the fused shards.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import cpu_layers
from pdserve.models.attention import AttentionMetadata, paged_attention
from pdserve.models.config import ModelConfig
from pdserve.models.fused_decode import FusedDecode
from pdserve.models.linear import Linear
from pdserve.models.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            # the native kernel (within an ulp of the steps below), else torch's op (bit-identical to them)
            out = cpu_layers.rms_norm(x, self.weight, self.eps)
            return out if out is not None else F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.rotary = rotary

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # x: [T, hidden]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.flatten(1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(config, rotary)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, kv_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    # HF name fragment -> (fused parameter fragment, shard id)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions or config.max_position_embeddings)
        # uninitialized: the checkpoint fills it (random init would cost ~0.4 s, and on meta seconds of imports)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, rotary) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden [T, hidden]
        x = self.embed_tokens(input_ids)
        fused = self._fused_decode(kv_caches)
        if fused is not None and fused.takes(x, meta):
            return self.norm(fused(x, positions, meta))
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(positions, x, kv_cache, meta)
        return self.norm(x)

    def _fused_decode(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> FusedDecode | None:
        """The one-call decode path for these caches, built on first use (None where the model or caches do
        not fit it: pdserve.models.fused_decode)."""
        cached = self.__dict__.get("_fused")
        if cached is None or cached[0] is not kv_caches:
            fused = FusedDecode(self, kv_caches) if FusedDecode.supports(self, kv_caches) else None
            self.__dict__["_fused"] = cached = (kv_caches, fused)
        return cached[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the parameter names filled."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "embed_tokens.weight" and self.config.tie_word_embeddings and "lm_head.weight" in params:
                self._copy(params["lm_head.weight"].data, tensor.t(), hf_name)
                filled.add("lm_head.weight")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            shard = None
            for fragment, (fused, shard_id) in self.stacked_params.items():
                if f".{fragment}." in name:
                    name, shard = name.replace(fragment, fused), shard_id
                    break
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no parameter in the model")
            param = params[name].data
            is_linear_weight = name.endswith("_proj.weight") or name == "lm_head.weight"
            if is_linear_weight:
                tensor = tensor.t()  # HF [out, in] -> ours [in, out]
            target = param if shard is None else self._shard(param, shard)
            self._copy(target, tensor, hf_name)
            filled.add(name if shard is None else f"{name}:{shard}")
        return filled

    @staticmethod
    def _copy(target: torch.Tensor, tensor: torch.Tensor, hf_name: str) -> None:
        if target.shape != tensor.shape:
            raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
        target.copy_(tensor)

    def _shard(self, data: torch.Tensor, shard) -> torch.Tensor:
        # fused weights are [in, out] (shards are column ranges); fused biases are [out]
        c = self.config
        if shard in ("q", "k", "v"):
            offsets = {"q": (0, c.q_size), "k": (c.q_size, c.kv_size), "v": (c.q_size + c.kv_size, c.kv_size)}
            start, size = offsets[shard]
        else:
            start, size = shard * c.intermediate_size, c.intermediate_size
        return data.narrow(data.dim() - 1, start, size)

    def expected_weights(self) -> set[str]:
        names = set()
        for name, _ in self.named_parameters():
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                names |= {f"{name}:{s}" for s in "qkv"}
            elif "gate_up_proj" in name:
                names |= {f"{name}:0", f"{name}:1"}
            else:
                names.add(name)
        return names


MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
