"""Weight-only quantized GEMV / small-batch GEMM on CUDA: `python -m pdserve.bench.quant_kernels --json`.

For int4 and int8 codes (group 32, float16 scales and offsets, as CudaQuantLinear holds GGUF weights)
and, on FP8 hardware, e4m3 weights, at Llama-3-8B's linear shapes and M = 1 (GEMV) and 16 rows of bf16
activations: the kernel's time (CUDA events, L2 flushed before each call, median), its achieved
bandwidth on the bytes it must read and write (weights + scales/offsets + x + y) as a fraction of a
device-to-device copy measured in the same run (read + write bytes), and its speed against
`F.linear` over the dequantized bf16 weight. int4 and int8 are timed through both kernel paths of
quant_matmul ("gemv": no tl.dot, "dot": dequantized tiles through tl.dot): `{kind}_{rows}_{key}` is the
best path's median (its name in `{kind}_{rows}_best_path`), `{kind}_{rows}_{path}_path_{key}` each
path's, and `int4_gemv_bandwidth_share` / `int8_gemv_bandwidth_share` the GEMV figures to watch.
Exits 2 with one line where there is no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from pdserve.bench.kernels import copy_bandwidth_gb_s, cuda_time_ms

SHAPES = {  # name -> (N, K): out, in features of Llama-3-8B's linears
    "o": (4096, 4096), "qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
}
ROWS = {"gemv": 1, "m16": 16}
GROUP_SIZE = 32
DTYPE = torch.bfloat16


def _log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


PATHS = ("gemv", "dot")  # quant_matmul's kernel paths, timed at every row count


def _case(kind: str, rows: str, shape: str, iters: int, flush: torch.Tensor, copy_gb_s: float,
          gen: torch.Generator) -> list[dict]:
    from pdserve.kernels.fp8_matmul import fp8_matmul, quantize_fp8_rows
    from pdserve.kernels.quant_matmul import dequantize_ref, n_major, pack_int4, quant_matmul

    (n, k), m = SHAPES[shape], ROWS[rows]
    x = torch.randn(m, k, device="cuda", generator=gen).to(DTYPE)
    if kind == "fp8":
        w8, w_scale = quantize_fp8_rows(torch.randn(n, k, device="cuda", generator=gen))
        w = (w8.float() * w_scale[:, None]).to(DTYPE)
        operands = [w8, w_scale]
        kernels = {"fp8": lambda: fp8_matmul(x, w8, w_scale)}
    else:
        bits = int(kind[3:])
        codes = torch.randint(0, 2**bits, (n, k), dtype=torch.uint8, device="cuda", generator=gen)
        packed = pack_int4(codes) if bits == 4 else codes
        scale = n_major((torch.rand(n, k // GROUP_SIZE, device="cuda", generator=gen) / 2**bits).half())
        offset = n_major((-(2 ** (bits - 1)) * scale.float()).half())
        w = dequantize_ref(packed, scale, offset, bits, GROUP_SIZE).to(DTYPE)
        del codes
        operands = [packed, scale, offset]
        kernels = {
            path: lambda path=path: quant_matmul(x, packed, scale, offset, bits, GROUP_SIZE, path=path)
            for path in PATHS
        }

    expected = F.linear(x, w)
    bf16_ms = cuda_time_ms(lambda: F.linear(x, w), iters, flush=flush)
    cases = []
    for path, kernel in kernels.items():
        y = kernel()
        rel_err = ((y.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
        nbytes = sum(t.numel() * t.element_size() for t in [*operands, x, y])
        ms = cuda_time_ms(kernel, iters, flush=flush)
        gb_s = nbytes / (ms * 1e-3) / 1e9
        cases.append({
            "kind": kind, "rows": rows, "shape": shape, "path": path, "m": m, "n": n, "k": k,
            "ms": round(ms, 4), "bf16_ms": round(bf16_ms, 4), "gb_s": round(gb_s, 1),
            "bandwidth_share": round(gb_s / copy_gb_s, 3), "speedup_vs_bf16": round(bf16_ms / ms, 3),
            "max_rel_err_vs_bf16": round(rel_err, 5),
        })
    return cases


def run(quick: bool = False, seed: int = 0) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("pdserve.bench.quant_kernels needs a CUDA device (Triton kernels compile only there)")
    from pdserve.kernels.fp8_matmul import device_has_fp8

    iters = 5 if quick else 20
    gen = torch.Generator(device="cuda").manual_seed(seed)
    copy_gb_s = copy_bandwidth_gb_s(iters=iters)
    _log(f"copy bandwidth {copy_gb_s:.0f} GB/s (read + write)")
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    flush = torch.empty(max(4 * l2, 256 << 20), dtype=torch.uint8, device="cuda")
    kinds = ["int4", "int8"] + (["fp8"] if device_has_fp8("cuda") else [])
    cases = []
    for kind in kinds:
        for rows in ROWS:
            for shape in SHAPES:
                for case in _case(kind, rows, shape, iters, flush, copy_gb_s, gen):
                    cases.append(case)
                    _log(str(case))
                torch.cuda.empty_cache()
    summary = {}
    for kind in kinds:
        for rows in ROWS:
            per_path = {}
            for path in sorted({c["path"] for c in cases if c["kind"] == kind}):
                mine = [c for c in cases if c["kind"] == kind and c["rows"] == rows and c["path"] == path]
                per_path[path] = {key: round(statistics.median(c[key] for c in mine), 3)
                                  for key in ("bandwidth_share", "speedup_vs_bf16")}
                if kind != "fp8":
                    for key, value in per_path[path].items():
                        summary[f"{kind}_{rows}_{path}_path_{key}"] = value
            best = max(per_path, key=lambda p: per_path[p]["bandwidth_share"])
            summary.update({f"{kind}_{rows}_{key}": value for key, value in per_path[best].items()})
            if kind != "fp8":
                summary[f"{kind}_{rows}_best_path"] = best
    return {
        "device": torch.cuda.get_device_name(0), "dtype": "bfloat16", "group_size": GROUP_SIZE,
        "fp8": "fp8" in kinds, "iters": iters, "copy_gb_s": round(copy_gb_s, 1),
        **summary, "cases": cases,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="one-line JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pdserve.bench.quant_kernels: no CUDA device, nothing to time", file=sys.stderr)
        return 2
    result = run(args.quick)
    print(json.dumps(result) if args.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
