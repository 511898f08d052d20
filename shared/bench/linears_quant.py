"""Weight-only quantized linears against float32 per shape, one process, same inputs:
`python -m pdserve.bench.linears_quant --json` (run it under `flock /tmp/pdserve-bench.lock`).

Each shape of SmolLM2-135M-Instruct's linears (qkv, o, gate_up, down, lm_head) is timed over all of its
layers in turn (30 distinct weights, so the small ones are not served from cache) at 1, 4, 16, 64 and 256
rows, for: float32 plain (MKL), float32 oneDNN-packed, what the float32 engine serves (plain at 1 row,
packed above), torch's int4 kernel over the file's Q4_1 codes, int8 with group scales (the int4 kernel
over two 4-bit planes), int8 per channel (`torch._weight_int8pack_mm`, round-to-nearest), pdserve's native
kernel on the same Q4_1 and Q8_0 codes (`native_int4`, `native_int8_group`: float32 input,
pdserve.kernels.cpu_quant; the engine's default where it builds), and the exact dequantize-then-float32 path
the quantized engine takes above `max_kernel_rows`. Ratios are float32 served time over each kernel's
(> 1: faster than float32).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch

from pdserve.models.linear import Linear
from pdserve.models.loader import load_model
from pdserve.kernels import cpu_native
from pdserve.models.quant_linear import MAX_KERNEL_ROWS, QuantLinear
from pdserve.models.quant_linear_native import NativeQuantLinear
from pdserve.models.quantization import quantize_rtn_symmetric
from pdserve.models.resolve import DEFAULT_MODEL, resolve_model_path

ROWS = (1, 4, 16, 64, 256)
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def _modules(model: torch.nn.Module, kind: str) -> list[torch.nn.Module]:
    return [m for n, m in model.named_modules() if n.split(".")[-1] == kind]


def _time_us(calls: list[Callable[[], object]], min_s: float) -> float:
    with torch.inference_mode():
        for call in calls:
            call()
        best, total, rounds = float("inf"), 0.0, 0
        while total < min_s or rounds < 3:
            start = time.perf_counter()
            for call in calls:
                call()
            elapsed = time.perf_counter() - start
            best, total, rounds = min(best, elapsed), total + elapsed, rounds + 1
    return best / len(calls) * 1e6


def _kernel_only(module: QuantLinear, x: torch.Tensor) -> Callable[[], object]:
    return lambda: module.kernel_mm(x)


def _at_kernel_rows(module: QuantLinear | NativeQuantLinear, x: torch.Tensor, rows: int) -> Callable[[], object]:
    def call() -> object:
        saved, module.max_kernel_rows = module.max_kernel_rows, rows
        try:
            return module(x)
        finally:
            module.max_kernel_rows = saved

    return call


def _dequant_path(module: QuantLinear, x: torch.Tensor) -> Callable[[], object]:
    return _at_kernel_rows(module, x, 0)


def _load_with(model_dir, quantization: str, kernels: str) -> torch.nn.Module:
    saved = os.environ.get(cpu_native.KERNEL_ENV)
    os.environ[cpu_native.KERNEL_ENV] = kernels
    try:
        return load_model(model_dir, torch.float32, "cpu", quantization=quantization)[0]
    finally:
        if saved is None:
            os.environ.pop(cpu_native.KERNEL_ENV)
        else:
            os.environ[cpu_native.KERNEL_ENV] = saved


def run(model: str | None = None, quick: bool = False, threads: int = 1) -> dict:
    model = model or DEFAULT_MODEL
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model_dir = resolve_model_path(model)
    fp32, _ = load_model(model_dir, torch.float32, "cpu", pack_weights=False)
    int4, int8 = _load_with(model_dir, "auto", "torch"), _load_with(model_dir, "int8", "torch")
    native = _load_with(model_dir, "auto", "native") if cpu_native.library() is not None else None
    min_s = 0.05 if quick else 0.3
    shapes = {}
    for kind in KINDS:
        plain = _modules(fp32, kind)
        packed = []
        for m in plain:
            copy = Linear(m.in_features, m.out_features)
            copy.weight = m.weight
            copy.pack()
            packed.append(copy)
        channel = [
            QuantLinear(quantize_rtn_symmetric(m.weight.detach().t(), kind), None, kind) for m in plain
        ]
        q4 = [m for m in _modules(int4, kind) if m.kernel == "int4"]
        q8 = [m for m in _modules(int8, kind) if m.kernel == "int8_split"]
        ours = [m for m in _modules(native, kind) if isinstance(m, NativeQuantLinear)] if native else []
        k, n = plain[0].in_features, plain[0].out_features
        per_rows = {}
        for rows in ROWS:
            x = torch.randn(rows, k)
            t = {
                "fp32_plain": _time_us([lambda m=m, x=x: x @ m.weight for m in plain], min_s),
                "fp32_onednn": _time_us(
                    [
                        lambda m=m, x=x: torch.ops.mkldnn._linear_pointwise(x, m.packed, None, "none", [], "")
                        for m in packed
                    ],
                    min_s,
                ),
                "int8_channel": _time_us([_kernel_only(m, x) for m in channel], min_s),
            }
            if q4:
                t["int4"] = _time_us([_kernel_only(m, x) for m in q4], min_s)
                t["int4_dequant_fp32"] = _time_us([_dequant_path(m, x) for m in q4], min_s)
            if ours:
                name = "native_int4" if ours[0].bits == 4 else "native_int8_group"
                t[name] = _time_us([_at_kernel_rows(m, x, 1 << 30) for m in ours], min_s)
            if q8:
                t["int8_group"] = _time_us([_kernel_only(m, x) for m in q8], min_s)
                t["int8_group_dequant_fp32"] = _time_us([_dequant_path(m, x) for m in q8], min_s)
            served = t["fp32_plain"] if rows == 1 else t["fp32_onednn"]
            quantized = {k: v for k, v in t.items() if not k.startswith("fp32")}
            per_rows[str(rows)] = {
                "us": {name: round(v, 1) for name, v in t.items()},
                "ratio_vs_fp32_served": {name: round(served / v, 3) for name, v in quantized.items()},
                "fastest_quantized": min(quantized, key=quantized.get),
            }
        shapes[kind] = {"in_features": k, "out_features": n, "layers": len(plain), "rows": per_rows}
    return {
        "bench": "linears_quant",
        "model": f"{model} cpu, activations float32 (torch's kernels take them as bfloat16)",
        "native_kernel": cpu_native.unavailable_reason() or "built",
        "threads": threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "max_kernel_rows": MAX_KERNEL_ROWS,
        "shapes": shapes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="one-line JSON")
    args = parser.parse_args()
    result = run(args.model, args.quick, args.threads)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
