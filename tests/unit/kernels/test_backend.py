import subprocess
import sys

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import BACKEND_ENV, attention_backend
from pdserve.kernels.paged_attention import paged_attention_triton
from pdserve.kernels.testing import assert_close, mixed_step
from pdserve.models.attention import paged_attention


def test_default_backend_follows_the_device(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert attention_backend("cpu") == "torch"
    assert attention_backend("cuda") == "triton"
    assert attention_backend(torch.device("cuda", 0)) == "triton"


def test_env_and_override_force_a_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert attention_backend("cuda") == "torch"
    assert attention_backend("cuda", override="triton") == "triton"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert attention_backend("cpu") == "triton"  # allowed here: the interpreter is on
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match="flash"):
        attention_backend("cpu")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        attention_backend("cpu", override="triton")
    assert attention_backend("cpu", override="torch") == "torch"


def test_package_import_loads_no_kernel():
    code = "import sys, pdserve.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert kernels.paged_decode_attention.__name__ == "paged_decode_attention"  # lazy names resolve
    with pytest.raises(AttributeError):
        kernels.no_such_kernel  # noqa: B018


@pytest.mark.parametrize(
    "dtype,group,block_size", [(torch.float32, 4, 16), (torch.bfloat16, 8, 32), (torch.float16, 1, 16)]
)
def test_triton_paged_attention_agrees_with_engine(dtype, group, block_size):
    """A mixed step as ModelRunner packs it: decodes in two groups, then a fresh and a continued prefill."""
    q, k, v, k_cache, v_cache, meta = mixed_step(
        [1, 9, 33, 70], [12, 5], [12, 45], num_kv_heads=2, group=group, head_dim=64, block_size=block_size,
        dtype=dtype, seed=group,
    )
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    expected = paged_attention(q, k, v, k_ref, v_ref, meta, 64**-0.5)
    out = paged_attention_triton(q, k, v, k_cache, v_cache, meta, 64**-0.5)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert_close(out, expected, dtype)


def test_triton_paged_attention_decode_only_and_prefill_only():
    for decodes, prefill_q, prefill_ctx in (([3, 20, 21], [], []), ([], [30], [30])):
        q, k, v, k_cache, v_cache, meta = mixed_step(
            decodes, prefill_q, prefill_ctx, num_kv_heads=1, group=4, head_dim=64, block_size=16,
            dtype=torch.float32, num_decode_groups=1,
        )
        expected = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.125)
        assert_close(paged_attention_triton(q, k, v, k_cache, v_cache, meta, 0.125), expected, torch.float32)
