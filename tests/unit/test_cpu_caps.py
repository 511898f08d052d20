"""CPU capability from /proc/cpuinfo flags, and the activation dtype `dtype="auto"` picks from it."""

from __future__ import annotations

import pytest

from pdserve.config import EngineConfig
from pdserve.cpu_caps import CpuCaps, auto_dtype, cpu_caps, parse_cpuinfo

EPYC = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma avx512f avx512bw\n\nprocessor\t: 1\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
ZEN4 = "flags\t\t: avx512f avx512_bf16 avx512_vnni\n"


@pytest.mark.parametrize(("text", "caps", "dtype"), [
    (EPYC, CpuCaps(), "float32"),
    (SAPPHIRE, CpuCaps(avx512_bf16=True, amx_bf16=True), "bfloat16"),
    (ZEN4, CpuCaps(avx512_bf16=True), "bfloat16"),
    ("", CpuCaps(), "float32"),
])
def test_flags_decide_bf16(text, caps, dtype):
    assert parse_cpuinfo(text) == caps
    assert auto_dtype("cpu", caps) == dtype


def test_describe_names_what_was_found():
    assert CpuCaps(avx512_bf16=True, amx_bf16=True).describe() == "CPU has AVX-512 BF16, AMX-BF16"
    assert CpuCaps().describe() == "CPU has no AVX-512 BF16 or AMX-BF16"


def test_this_machine_agrees_with_its_cpuinfo():
    flags = open("/proc/cpuinfo").read()
    assert cpu_caps().avx512_bf16 == (" avx512_bf16" in flags)
    assert cpu_caps().amx_bf16 == (" amx_bf16" in flags)


def test_engine_dtype_auto_resolves_and_the_default_stays_float32_on_cpu():
    assert EngineConfig(device="cpu").resolved_dtype == "float32"
    auto = EngineConfig(device="cpu", dtype="auto")
    assert auto.resolved_dtype == auto_dtype("cpu") and auto.torch_dtype is not None
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        EngineConfig(device="cpu", dtype="bf16")
