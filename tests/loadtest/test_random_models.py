"""Random-weight Llama checkpoints of a chosen size: written once, loadable, sized as asked."""

from __future__ import annotations

import json

import pytest
from pdserve.loadtest.models import ensure_random_llama, llama_config, resolve_model

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "max_position_embeddings": 512}


def test_config_overrides_and_derived_head_dim():
    config = llama_config(**SMALL)
    assert config["head_dim"] == 32 and config["vocab_size"] == 384 and config["num_hidden_layers"] == 1
    with pytest.raises(ValueError):
        llama_config(hidden_layers=3)


def test_checkpoint_is_written_once_and_serves(tmp_path):
    from pdserve.engine import LLM
    from pdserve.sampling_params import SamplingParams

    path = ensure_random_llama(SMALL, tmp_path)
    assert ensure_random_llama(SMALL, tmp_path) == path
    assert resolve_model({"random_llama": SMALL}, tmp_path) == str(path)
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 64
    assert json.loads((path / "tokenizer_config.json").read_text())["model_max_length"] == 512
    out = LLM(model=str(path), device="cpu").generate([[1, 2, 3]], SamplingParams(max_tokens=4, min_tokens=4,
                                                                                  ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert resolve_model("tiny") == "tiny"
    with pytest.raises(ValueError):
        resolve_model({"llama": {}})
