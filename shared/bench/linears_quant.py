"""Weight-only quantized linears against float32 per shape, one process, same inputs:
`python -m pdserve.bench.linears_quant --json` (run it under `flock /tmp/pdserve-bench.lock`).

Each shape of SmolLM2-135M-Instruct's linears (qkv, o, gate_up, down, lm_head) is timed over all of its
layers in turn (30 distinct weights, so the small ones are not served from cache) at 1, 4, 16, 64 and 256
rows, for: float32 plain (MKL), float32 oneDNN-packed, what the float32 engine serves (plain at 1 row,
packed above), torch's int4 kernel over the file's Q4_1 codes, int8 with group scales (the int4 kernel
over two 4-bit planes), int8 per channel (`torch._weight_int8pack_mm`, round-to-nearest), and the exact
dequantize-then-float32 path the quantized engine takes above `max_kernel_rows`. Ratios are float32
served time over each kernel's (> 1: faster than float32).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from pdserve.models.linear import Linear
from pdserve.models.loader import load_model
from pdserve.models.quant_linear import MAX_KERNEL_ROWS, QuantLinear
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


def _dequant_path(module: QuantLinear, x: torch.Tensor) -> Callable[[], object]:
    def call() -> object:
        rows, module.max_kernel_rows = module.max_kernel_rows, 0
        try:
            return module(x)
        finally:
            module.max_kernel_rows = rows

    return call


def run(model: str | None = None, quick: bool = False, threads: int = 1) -> dict:
    model = model or DEFAULT_MODEL
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model_dir = resolve_model_path(model)
    fp32, _ = load_model(model_dir, torch.float32, "cpu", pack_weights=False)
    int4, _ = load_model(model_dir, torch.float32, "cpu", quantization="auto")
    int8, _ = load_model(model_dir, torch.float32, "cpu", quantization="int8")
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
        "model": f"{model} cpu, activations float32 (kernels take them as bfloat16)",
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
