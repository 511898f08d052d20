"""pdserve's native CPU kernels (`cpu/*.c`), built on first use into one library loaded with ctypes.

- `cpu/quant_gemm.c` (AVX-512 VNNI), `cpu/quant_gemm_avx2.c` (AVX2), `cpu/quant_gemm_f32.c` (portable), `cpu/quant_dequant.c`
  (layout in `cpu/quant_layout.h`): weight-only int4/int8 linears (pdserve.kernels.cpu_quant);
- `cpu/paged_decode.c`: decode attention over the paged float32 KV cache and the KV store
  (pdserve.kernels.cpu_attention);
- `cpu/norm_rope.c`: float32 RMSNorm and rotary embedding (pdserve.kernels.cpu_layers);
- `cpu/decode_layers.c`: every decoder layer of a decode step in one call (pdserve.models.fused_decode).

Compiled with the system C compiler (`cc -O3 -march=native -fopenmp`, about two seconds) into
`$PDSERVE_KERNEL_CACHE` (default `$PDSERVE_CACHE/kernels`, `~/.cache/pdserve/kernels`), keyed by the
sources, the compiler and the CPU's flags. Its OpenMP calls resolve to the libgomp torch has loaded, so it
runs on torch's threads (`torch.set_num_threads`). Without a compiler `library()` is None and
`unavailable_reason()` says why, and torch's kernels serve; PDSERVE_CPU_KERNELS=torch forces them.
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

import torch  # noqa: F401  (loaded first: the library's libgomp.so.1 resolves to torch's)

KERNEL_ENV = "PDSERVE_CPU_KERNELS"
CACHE_ENV = "PDSERVE_KERNEL_CACHE"
SOURCES = tuple(Path(__file__).parent / "cpu" / name
                for name in ("quant_gemm.c", "quant_gemm_avx2.c", "quant_gemm_f32.c", "quant_dequant.c", "paged_decode.c",
                             "norm_rope.c", "decode_layers.c"))
HEADERS = tuple(Path(__file__).parent / "cpu" / name for name in ("simd_math.h", "quant_layout.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


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
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, version, " ".join(flags), _cpu_flags()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"pdserve_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # concurrent builders each write their own
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(built), "-lm"], capture_output=True,
                       text=True, check=True)
        os.replace(built, target)
    return target


def _bind(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.pd_quant_gemm.argtypes = [ptr, i64, i64, ptr, ctypes.c_int, ptr, ptr, ctypes.c_int, i64, i64, ptr]
    lib.pd_quant_gemm.restype = None
    lib.pd_quant_dequant.argtypes = [ptr, ctypes.c_int, ptr, ptr, ctypes.c_int, i64, i64, i64, i64, ptr]
    lib.pd_quant_dequant.restype = None
    lib.pd_quant_isa.restype = ctypes.c_int
    lib.pd_paged_decode.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_int, i64, i64, i64, ptr, i64, ptr,
                                    ctypes.c_float,
                                    ptr]
    lib.pd_paged_decode.restype = ctypes.c_int
    lib.pd_store_kv.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, i64, i64, ptr, ptr, ctypes.c_int]
    lib.pd_store_kv.restype = ctypes.c_int
    lib.pd_kv_half_supported.argtypes = []
    lib.pd_kv_half_supported.restype = ctypes.c_int
    lib.pd_rms_norm.argtypes = [ptr, ptr, i64, i64, ctypes.c_float, ptr]
    lib.pd_rms_norm.restype = None
    lib.pd_rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr]
    lib.pd_rotary.restype = ctypes.c_int
    lib.pd_decode_scratch.argtypes = [ptr, i64]
    lib.pd_decode_scratch.restype = i64
    lib.pd_decode_layers.argtypes = [ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr]
    lib.pd_decode_layers.restype = ctypes.c_int
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
    """The loaded kernel library, or None (torch's kernels serve: PDSERVE_CPU_KERNELS=torch, or no
    compiler)."""
    if os.environ.get(KERNEL_ENV, "native") == "torch":
        return None
    return _load(flags)[0]


def unavailable_reason(flags: tuple[str, ...] = FLAGS) -> str:
    if os.environ.get(KERNEL_ENV, "native") == "torch":
        return f"{KERNEL_ENV}=torch"
    return _load(flags)[1]
