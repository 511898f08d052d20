"""`pdserve bench engine`'s llama.cpp side, without llama.cpp: the bytes its decode step reads from a GGUF file
(every tensor but an untied token embedding; a tied one is the output layer too) and from its f16 cache, and
why the peer does not run when it cannot. The run itself is in tests/correctness/test_bench_peer.py."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pdserve.bench.engine import _llama_cpp_b1  # noqa: E402
from pdserve.bench.engine_peer import gguf_step_weight_bytes, kv_bytes_per_token  # noqa: E402

Q = gguf.GGMLQuantizationType


def _write(path, names):
    writer = gguf.GGUFWriter(str(path), "llama")
    for name in names:
        array = np.ones((8, 64), dtype=np.float32)  # 512 values: 16 Q8_0 blocks of 34 bytes, or 2,048 f32 bytes
        qtype = Q.Q8_0 if name.endswith("embd.weight") else Q.F32
        data = gguf.quants.quantize(array, qtype) if qtype == Q.Q8_0 else array
        writer.add_tensor(name, data, raw_dtype=qtype if qtype == Q.Q8_0 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_tied_embedding_is_read_as_the_output_layer(tmp_path):
    tied = _write(tmp_path / "tied.gguf", ["token_embd.weight", "blk.0.attn_q.weight"])
    assert gguf_step_weight_bytes(tied) == 16 * 34 + 2048


def test_an_untied_embedding_is_indexed_not_read(tmp_path):
    untied = _write(tmp_path / "untied.gguf", ["token_embd.weight", "output.weight", "blk.0.attn_q.weight"])
    assert gguf_step_weight_bytes(untied) == 2048 + 2048


def test_kv_bytes_per_token_in_an_f16_cache():
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv_bytes_per_token(config) == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token({**config, "head_dim": 32}) == 2 * 30 * 3 * 32 * 2
    assert kv_bytes_per_token({k: v for k, v in config.items() if k != "num_key_value_heads"}) == 2 * 30 * 9 * 64 * 2


@pytest.mark.parametrize(("model", "mode", "reason"), [
    (None, "auto", "not a GGUF file"), ("tiny", "auto", "not a GGUF file"), (None, "off", "--llama-cpp off")])
def test_the_peer_says_why_it_did_not_run(model, mode, reason):
    assert reason in _llama_cpp_b1(model, {}, [1, 2, 3], 4, 1, mode, lambda: 1.0)["skipped"]
