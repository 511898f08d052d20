"""CPU weight packing: packed layers compute what the plain ones do, and only where oneDNN applies."""

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine.llm import LLM
from pdserve.models.linear import Linear, can_pack, pack_linears
from pdserve.sampling_params import SamplingParams


def _layer(bias: bool) -> Linear:
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=bias)
    torch.nn.init.normal_(layer.weight)
    if bias:
        torch.nn.init.normal_(layer.bias)
    return layer.requires_grad_(False)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 2, 9, 64])
def test_packed_layer_matches_plain(bias, rows):
    layer = _layer(bias)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        expected = layer(x)
        layer.pack()
        got = layer(x)
    assert layer.packed is not None and layer.weight is not None
    assert got.shape == expected.shape == (rows, 80)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_one_row_reads_the_plain_weight_and_more_rows_the_packed_one():
    layer = _layer(bias=False)
    with torch.inference_mode():
        layer.pack()
        layer.weight.zero_()  # only the packed copy still holds the values
        assert layer(torch.randn(1, 48)).abs().max() == 0
        assert layer(torch.randn(3, 48)).abs().max() > 0


def test_pack_linears_packs_cpu_float32_only():
    model = torch.nn.Sequential(_layer(False), _layer(True))
    assert can_pack(torch.device("cpu"), torch.float32)
    assert not can_pack(torch.device("cpu"), torch.float16)
    assert not can_pack(torch.device("meta"), torch.float32)
    assert pack_linears(model) == 2
    assert pack_linears(model) == 0  # already packed
    half = torch.nn.Sequential(Linear(8, 8).half())
    assert pack_linears(half) == 0 and half[0].packed is None


def test_engine_packs_by_default_and_generates_the_same_tokens_unpacked():
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 13, 17, 21], [2, 4, 6, 8]]
    outputs = {}
    for pack in (True, False):
        llm = LLM(EngineConfig(model="tiny", device="cpu", dtype="float32", pack_weights=pack))
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
        assert linears and all((m.packed is not None) == pack for m in linears)
        outputs[pack] = [o.token_ids for o in llm.generate(prompts, [params, params])]
    assert outputs[True] == outputs[False]


def test_bench_linears_prints_both_paths_as_json():
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).with_name("pdserve")
    out = subprocess.run([str(script), "bench", "linears", "--quick", "--model", "tiny", "--json"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    result = json.loads(out)
    assert result["bench"] == "linears" and result["rows"][0] == 1
    for key in ("mkl_ms", "packed_ms", "speedup_packed", "mkl_ratio_to_one_row", "packed_ratio_to_one_row"):
        assert len(result[key]) == len(result["rows"]) and all(v > 0 for v in result[key])
