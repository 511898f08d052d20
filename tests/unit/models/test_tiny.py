import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import pdserve.models.tiny as tiny
from pdserve.models.tiny import TINY_CONFIG, ensure_tiny_checkpoint, resolve_model_path
from pdserve.models.tokenizer import Tokenizer

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("cache"))


def expected_shapes() -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = 256, 688, 384
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(4):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (256, hidden),
            f"{p}.self_attn.k_proj.weight": (128, hidden),
            f"{p}.self_attn.v_proj.weight": (128, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, 256),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def test_layout_and_config(tiny_dir: Path) -> None:
    assert tiny_dir.name == "tiny-v1"
    assert sorted(p.name for p in tiny_dir.iterdir()) == FILES
    assert [p.name for p in tiny_dir.parent.iterdir()] == ["tiny-v1"]
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (256, 4, 4)
    assert config["head_dim"] * config["num_attention_heads"] == 256
    assert config["vocab_size"] == 384 and config["tie_word_embeddings"] is False


def test_weights(tiny_dir: Path) -> None:
    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert {name: tuple(t.shape) for name, t in tensors.items()} == expected_shapes()
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert torch.equal(tensors["model.norm.weight"], torch.ones(256))
    assert tensors["model.embed_tokens.weight"].std().item() == pytest.approx(1.0, rel=0.05)
    assert tensors["model.layers.0.mlp.down_proj.weight"].std().item() == pytest.approx(688**-0.5, rel=0.05)
    assert not torch.equal(
        tensors["model.layers.0.mlp.gate_proj.weight"], tensors["model.layers.0.mlp.up_proj.weight"]
    )


def test_tokenizer_matches_config(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    tok = Tokenizer.from_dir(tiny_dir)
    assert tok.vocab_size <= config["vocab_size"]
    assert tok.bos_token_id == config["bos_token_id"]
    assert config["eos_token_id"] in tok.eos_token_ids
    assert tok.decode(tok.encode("naïve 漢字 🧪")) == "naïve 漢字 🧪"


def test_deterministic_bytes(tmp_path: Path, tiny_dir: Path) -> None:
    other = ensure_tiny_checkpoint(tmp_path)
    for name in FILES:
        assert (other / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_idempotent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = ensure_tiny_checkpoint(tmp_path)
    mtimes = {name: (first / name).stat().st_mtime_ns for name in FILES}
    monkeypatch.setattr(tiny, "write_tiny_checkpoint", lambda path: pytest.fail("rewrote the checkpoint"))
    assert ensure_tiny_checkpoint(tmp_path) == first
    assert {name: (first / name).stat().st_mtime_ns for name in FILES} == mtimes


def test_lost_race_keeps_winner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write = tiny.write_tiny_checkpoint

    def write_then_lose_race(path: Path) -> None:
        write(path)
        winner = tmp_path / "winner"
        winner.mkdir()
        write(winner)
        winner.rename(tmp_path / "tiny-v1")

    monkeypatch.setattr(tiny, "write_tiny_checkpoint", write_then_lose_race)
    path = ensure_tiny_checkpoint(tmp_path)
    assert path == tmp_path / "tiny-v1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-v1"]
    assert sorted(p.name for p in path.iterdir()) == FILES


def test_concurrent_writers(tmp_path: Path) -> None:
    barrier = threading.Barrier(4)
    results: list[Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        barrier.wait()
        try:
            results.append(ensure_tiny_checkpoint(tmp_path))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == [tmp_path / "tiny-v1"] * 4
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-v1"]
    assert Tokenizer.from_dir(results[0]).vocab_size == 262


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(path: Path) -> None:
        (path / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(tiny, "write_tiny_checkpoint", broken)
    with pytest.raises(OSError, match="disk full"):
        ensure_tiny_checkpoint(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_from_env_and_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "env"))
    assert ensure_tiny_checkpoint() == tmp_path / "env" / "tiny-v1"
    monkeypatch.delenv("PDSERVE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert ensure_tiny_checkpoint() == tmp_path / "home" / ".cache" / "pdserve" / "tiny-v1"


def test_resolve_model_path(tmp_path: Path) -> None:
    assert resolve_model_path("tiny", cache_dir=tmp_path) == tmp_path / "tiny-v1"
    assert resolve_model_path(str(tmp_path / "tiny-v1")) == tmp_path / "tiny-v1"
    with pytest.raises(FileNotFoundError, match="meta-llama/Llama-3-8B"):
        resolve_model_path("meta-llama/Llama-3-8B")
    (tmp_path / "file").write_text("")
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path / "file"))


def test_loads_in_transformers_with_separated_logits(tiny_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, info = transformers.LlamaForCausalLM.from_pretrained(str(tiny_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = Tokenizer.from_dir(tiny_dir)
    ids = torch.tensor(
        [tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello, pdserve!"}]))]
    )
    with torch.no_grad():
        logits = model.eval()(ids).logits[0]
    assert logits.shape == (ids.shape[1], TINY_CONFIG["vocab_size"])
    top2 = logits.topk(2, dim=-1).values
    assert logits.std().item() > 1.0
    assert (top2[:, 0] - top2[:, 1]).mean().item() > 0.3
