"""The native CPU kernel for weight-only quantized linears (`cpu/quant_gemm.c`), built on first use.

torch's CPU int4/int8 kernels are vectorized only for bfloat16 input and run at under half of one core's
bandwidth at one row; this kernel takes float32 input. On AVX-512 VNNI it multiplies the codes with x
held in two int8 planes per 32-element block (relative error under 2^-15 of the block's largest |x|) in
int32 dot products; elsewhere it dequantizes each row exactly and takes a float32 dot product.

The library is compiled with the system C compiler (`cc -O3 -march=native -fopenmp`, about a second) into
`$PDSERVE_KERNEL_CACHE` (default `$PDSERVE_CACHE/kernels`, `~/.cache/pdserve/kernels`), keyed by the
source, the compiler and the CPU's flags, and loaded with ctypes. Its OpenMP calls resolve to the libgomp torch has loaded, so it
runs on torch's threads (`torch.set_num_threads`). Without a compiler `library()` is None and
`unavailable_reason()` says why; the env var PDSERVE_CPU_QUANT_KERNEL=torch forces torch's kernels.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

KERNEL_ENV = "PDSERVE_CPU_QUANT_KERNEL"
CACHE_ENV = "PDSERVE_KERNEL_CACHE"
SOURCE = Path(__file__).parent / "cpu" / "quant_gemm.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
PAIR = 64  # elements per pair-block of the layout


def pack_order() -> torch.Tensor:
    """[64] element index held at each position of a pair-block (the C file's layout)."""
    p = torch.arange(PAIR)
    lane = p // 4
    return (lane % 2) * 32 + (lane // 2) * 4 + p % 4


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] uint8 -> the kernel's packed layout: [N, K] (8 bits) or [N, K / 2] (4 bits) uint8."""
    n, k = codes.shape
    placed = codes.reshape(n, k // PAIR, PAIR)[:, :, pack_order()]
    if bits == 8:
        return placed.reshape(n, k).contiguous()
    chunks = k // (2 * PAIR)  # two pairs per 64 bytes: the even pair's codes low, the odd pair's high
    body = placed[:, : 2 * chunks].reshape(n, chunks, 2, PAIR)
    parts = [(body[:, :, 0] | (body[:, :, 1] << 4)).reshape(n, -1)]
    if k % (2 * PAIR):  # a last pair alone: positions p (low) and p + 32 (high) in byte p
        last = placed[:, -1]
        parts.append(last[:, :32] | (last[:, 32:] << 4))
    return torch.cat(parts, dim=1).contiguous()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _cache_dir() -> Path:
    if root := os.environ.get(CACHE_ENV):
        return Path(root)
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve") / "kernels"


def _build(compiler: str, flags: tuple[str, ...]) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), version, " ".join(flags), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"quant_gemm-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # concurrent builders each write their own
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], capture_output=True, text=True,
                       check=True)
        os.replace(built, target)
    return target


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pd_quant_gemm.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, ptr, ptr, i64, ptr]
    lib.pd_quant_gemm.restype = None
    lib.pd_quant_dequant.argtypes = [ptr, ctypes.c_int, ptr, ptr, i64, i64, i64, ptr]
    lib.pd_quant_dequant.restype = None
    lib.pd_quant_isa.restype = ctypes.c_int
    return lib


@functools.cache
def _load(flags: tuple[str, ...]) -> tuple[ctypes.CDLL | None, str]:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (cc) on PATH"
    try:
        return _bind(_build(compiler, flags)), ""
    except subprocess.CalledProcessError as exc:
        return None, f"{compiler} failed: {(exc.stderr or '').strip().splitlines()[-1:]}"
    except OSError as exc:
        return None, f"cannot build or load the kernel: {exc}"


def library(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL | None:
    """The loaded kernel library, or None (torch's kernels serve: PDSERVE_CPU_QUANT_KERNEL=torch, or no
    compiler)."""
    if os.environ.get(KERNEL_ENV, "native") == "torch":
        return None
    return _load(flags)[0]


def unavailable_reason(flags: tuple[str, ...] = FLAGS) -> str:
    if os.environ.get(KERNEL_ENV, "native") == "torch":
        return f"{KERNEL_ENV}=torch"
    return _load(flags)[1]


def isa(lib: ctypes.CDLL) -> str:
    """"vnni" (AVX-512 VNNI, x in two int8 planes) or "f32" (exact float32 dot products)."""
    return "vnni" if lib.pd_quant_isa() == 1 else "f32"


def quant_gemm(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, bits: int, scale: torch.Tensor,
               offset: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 contiguous -> [M, N] float32; scale, offset [N, K / 32] float32."""
    m, k = x.shape
    n = scale.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib.pd_quant_gemm(x.data_ptr(), m, k, packed.data_ptr(), bits, scale.data_ptr(), offset.data_ptr(), n,
                      y.data_ptr())
    return y


def quant_dequant(lib: ctypes.CDLL, packed: torch.Tensor, bits: int, scale: torch.Tensor,
                  offset: torch.Tensor, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
    """Rows start:end of w into `out` [end - start, K] float32 (exactly code * scale + offset)."""
    lib.pd_quant_dequant(packed.data_ptr(), bits, scale.data_ptr(), offset.data_ptr(), start, end,
                         out.shape[1], out.data_ptr())
    return out
