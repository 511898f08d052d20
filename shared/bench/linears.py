"""`pdserve bench linears`: a model's linear layers at 1..256 rows, MKL (plain weight) against what a
packed engine runs (oneDNN's packed weight from 2 rows, the plain one for 1), same process and inputs. The physical reference is one row through MKL's GEMV,
which streams every weight once (memory-bound): `ratio_to_one_row` shows what extra rows cost."""

from __future__ import annotations

import time

import torch

from pdserve.models.linear import Linear
from pdserve.models.loader import load_model
from pdserve.models.resolve import resolve_model_path, served_model_name

ROWS = (1, 2, 5, 9, 16, 64, 256)


def _stack_ms(model: torch.nn.Module, rows: int, repeats: int) -> float:
    """One pass over every linear layer (the LM head included) with `rows` input rows."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}
    with torch.inference_mode():
        for _ in range(2):
            for m in linears:
                m(inputs[m.in_features])
        start = time.perf_counter()
        for _ in range(repeats):
            for m in linears:
                m(inputs[m.in_features])
    return (time.perf_counter() - start) / repeats * 1e3


def run(model: str | None = None, quick: bool = False, threads: int = 1) -> dict:
    model = model or "smollm2-135m-instruct"
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net, _ = load_model(resolve_model_path(model), torch.float32, "cpu", pack_weights=False)
    repeats = 3 if quick else 10
    mkl = {r: _stack_ms(net, r, repeats) for r in ROWS}
    packed_layers = [m for m in net.modules() if isinstance(m, Linear)]
    for m in packed_layers:
        m.pack()
    packed = {r: _stack_ms(net, r, repeats) for r in ROWS}
    return {
        "bench": "linears",
        "model": f"{served_model_name(model)} fp32 cpu",
        "threads": threads,
        "rows": list(ROWS),
        "mkl_ms": [round(mkl[r], 2) for r in ROWS],
        "packed_ms": [round(packed[r], 2) for r in ROWS],
        "speedup_packed": [round(mkl[r] / packed[r], 2) for r in ROWS],
        "mkl_ratio_to_one_row": [round(mkl[r] / mkl[1], 2) for r in ROWS],
        "packed_ratio_to_one_row": [round(packed[r] / mkl[1], 2) for r in ROWS],
    }
