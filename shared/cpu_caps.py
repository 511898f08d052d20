"""What this CPU can run fast, read from /proc/cpuinfo at run time (machines differ between sessions), and
the activation dtype `dtype="auto"` picks from it."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuCaps:
    avx512_bf16: bool = False
    amx_bf16: bool = False

    @property
    def has_bf16(self) -> bool:
        """bf16 matmuls in hardware: AVX-512 BF16 dot products or AMX tiles."""
        return self.avx512_bf16 or self.amx_bf16

    def describe(self) -> str:
        found = [name for name, on in (("AVX-512 BF16", self.avx512_bf16), ("AMX-BF16", self.amx_bf16)) if on]
        return f"CPU has {', '.join(found)}" if found else "CPU has no AVX-512 BF16 or AMX-BF16"


def parse_cpuinfo(text: str) -> CpuCaps:
    """Flags of the first processor listed (the kernel lists the same flags for every core)."""
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            break
    return CpuCaps(avx512_bf16="avx512_bf16" in flags, amx_bf16="amx_bf16" in flags)


@functools.cache
def cpu_caps() -> CpuCaps:
    """This machine's; no /proc/cpuinfo (not Linux): no bf16 claimed."""
    try:
        return parse_cpuinfo(CPUINFO.read_text())
    except OSError:
        return CpuCaps()


def auto_dtype(device: str, caps: CpuCaps | None = None) -> str:
    """bfloat16 where the hardware has it (a CUDA device that supports it, a CPU with AVX-512 BF16 or AMX),
    float32 elsewhere."""
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"
    return "bfloat16" if (caps or cpu_caps()).has_bf16 else "float32"
