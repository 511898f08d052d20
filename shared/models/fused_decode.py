"""All decoder layers of a decode-only step in one native call (`cpu/decode_layers.c`), for Llama-family
models whose linears are all served by the native quantized kernel on CPU in float32.

The per-op path costs about twenty torch ops and a dozen module calls a layer, which at one token take
longer than the layer's arithmetic outside its weight reads; the native call runs the same kernels
(pdserve.kernels.cpu_quant, cpu_attention, cpu_layers) back to back. Steps with prefill chunks, other
linears, biases or another attention backend take the per-op path.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pdserve.kernels.cpu_attention import is_half, native_cache
from pdserve.kernels.cpu_native import library
from pdserve.models.attention import AttentionMetadata
from pdserve.models.quant_linear import MAX_KERNEL_ROWS
from pdserve.models.quant_linear_native import NativeQuantLinear

i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class QLinear(ctypes.Structure):
    _fields_ = [("packed", ptr), ("scale", ptr), ("offset", ptr), ("bits", i64), ("half", i64),
                ("group", i64), ("N", i64), ("K", i64)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", ptr), ("post_attention_norm", ptr), ("qkv", QLinear), ("o", QLinear),
                ("gate_up", QLinear), ("down", QLinear), ("k_cache", ptr), ("v_cache", ptr)]


class Dims(ctypes.Structure):
    _fields_ = [("hidden", i64), ("heads", i64), ("kv_heads", i64), ("head_dim", i64), ("intermediate", i64),
                ("eps", f32), ("scale", f32), ("cos", ptr), ("sin", ptr), ("max_positions", i64),
                ("num_blocks", i64), ("block_size", i64), ("block_stride", i64), ("kv_half", i64)]


def _qlinear(linear: NativeQuantLinear, held: list[torch.Tensor]) -> QLinear:
    scale = linear.scale
    held += [linear.packed, scale, linear.offset]
    return QLinear(linear.packed.data_ptr(), scale.data_ptr(), linear.offset.data_ptr(), linear.bits,
                   int(scale.dtype is torch.float16), linear.in_features // scale.shape[1],
                   linear.out_features, linear.in_features)


def _f32(t: torch.Tensor) -> bool:
    return t.dtype is torch.float32 and t.device.type == "cpu" and t.is_contiguous()


class FusedDecode:
    """Built for one model and one set of KV caches (it holds their addresses): `takes` says whether a
    step can run here, `__call__` runs every layer on the residual stream x [n, hidden] in place."""

    def __init__(self, model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.lib = library()
        c, rotary = model.config, model.layers[0].self_attn.rotary
        # every tensor whose address a record holds is kept alive here (a model reloaded after this was
        # built would be read stale, never freed memory)
        held: list[torch.Tensor] = [rotary.cos, rotary.sin]
        self.kv_caches = kv_caches
        self.layers = (Layer * len(model.layers))()
        for record, layer, (k_cache, v_cache) in zip(self.layers, model.layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            norms = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            held += norms
            record.input_norm, record.post_attention_norm = norms[0].data_ptr(), norms[1].data_ptr()
            record.qkv, record.o = _qlinear(attn.qkv_proj, held), _qlinear(attn.o_proj, held)
            record.gate_up, record.down = _qlinear(mlp.gate_up_proj, held), _qlinear(mlp.down_proj, held)
            record.k_cache, record.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        k_cache = kv_caches[0][0]
        self.dims = Dims(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                         c.rms_norm_eps, model.layers[0].self_attn.scale, rotary.cos.data_ptr(),
                         rotary.sin.data_ptr(), rotary.cos.shape[0], k_cache.shape[0], k_cache.shape[1],
                         k_cache.stride(0), is_half(k_cache))
        self.held = held
        self._layers_ptr, self._dims_ptr = ctypes.addressof(self.layers), ctypes.addressof(self.dims)
        self._scratch = torch.empty(0)

    @staticmethod
    def supports(model: nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """The model's layers are all native-quantized without biases, its norms and rotary tables float32
        on CPU, and every layer's caches are float32 or float16 pool views the native attention reads."""
        c = getattr(model, "config", None)
        if library() is None or c is None or c.sliding_window is not None or not hasattr(model, "layers"):
            return False
        if len(kv_caches) != len(model.layers) or not _f32(model.layers[0].self_attn.rotary.cos):
            return False
        if not all(native_cache(k_cache, v_cache) for k_cache, v_cache in kv_caches):  # quantized caches: no
            return False
        strides = {k.stride() for k, _ in kv_caches}
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(type(lin) is NativeQuantLinear and lin.bias is None for lin in linears):
                return False
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if not all(_f32(w) for w in norms):
                return False
        return len(strides) == 1

    def takes(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """A decode-only step of at most MAX_KERNEL_ROWS sequences (above it the per-op path, layer by layer,
        with the same linear kernel)."""
        return (meta.backend == "torch" and not meta.prefills and bool(meta.decode_groups)
                and x.shape[0] <= MAX_KERNEL_ROWS
                and meta.num_decode_tokens == x.shape[0] and x.dtype is torch.float32 and x.is_contiguous()
                and not torch.is_grad_enabled())

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [n, hidden] float32, updated in place and returned
        n = x.shape[0]
        tables, lens = _one_table(meta, n)
        positions = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        need = self.lib.pd_decode_scratch(self._dims_ptr, n)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need)
        if self.lib.pd_decode_layers(x.data_ptr(), n, self._dims_ptr, self._layers_ptr, len(self.layers),
                                     positions.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                                     tables.shape[1], lens.data_ptr(), self._scratch.data_ptr()):
            raise IndexError("decode step: a position, slot or block id is outside its table, or a context "
                             "outruns its block table")
        return x


def _one_table(meta: AttentionMetadata, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode groups' block tables as one [n, width] int64 table (zero-padded) and their context lengths
    [n]: the native attention reads each row to its own length, so the grouping torch's padded gather needs
    does not matter here."""
    groups = meta.decode_groups
    if len(groups) == 1:
        group = groups[0]
        return group.block_tables.to(torch.int64).contiguous(), group.context_lens.to(torch.int64).contiguous()
    width = max(g.block_tables.shape[1] for g in groups)
    tables = torch.zeros(n, width, dtype=torch.int64)
    lens = torch.zeros(n, dtype=torch.int64)  # a row no group fills keeps length 0: the kernel refuses it
    for g in groups:
        rows = slice(g.start, g.start + g.num_seqs)
        tables[rows, : g.block_tables.shape[1]] = g.block_tables
        lens[rows] = g.context_lens
    return tables, lens
