import pytest
import torch

from pdserve.bench import kernels as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure")
def test_bench_fails_cleanly_without_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        bench.run(quick=True)


def test_bench_grid_is_the_documented_one():
    assert bench.BATCHES == (1, 32, 128) and bench.CONTEXTS == (512, 4096, 16384)
    assert (bench.NUM_HEADS, bench.NUM_KV_HEADS, bench.HEAD_DIM, bench.BLOCK_SIZE) == (32, 8, 128, 16)
    assert bench.DTYPE == torch.bfloat16
