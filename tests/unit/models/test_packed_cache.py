"""The native kernel's packed weights kept beside the model: written by the first load, mapped (not copied)
by the next, and never trusted when they do not match their source or their index."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")

from pdserve.kernels import cpu_quant
from pdserve.models import packed_cache
from pdserve.models.gguf import QUANTIZED_FILE, ensure_hf_checkpoint
from pdserve.models.loader import load_model
from pdserve.models.quant_linear_native import NativeQuantLinear

pytestmark = pytest.mark.skipif(cpu_quant.library() is None, reason="native kernel not built")
PROMPT = torch.tensor([3, 17, 42, 99, 250])


@pytest.fixture
def model_dir(tmp_path: Path, llama_gguf, monkeypatch) -> Path:
    monkeypatch.setenv(cpu_quant.KERNEL_ENV, "native")
    path, _ = llama_gguf(tied=True)
    return ensure_hf_checkpoint(path, tmp_path / "cache")


def _native(model: torch.nn.Module) -> dict[str, NativeQuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, NativeQuantLinear)}


def _outputs(model: torch.nn.Module) -> torch.Tensor:
    x = model.embed_tokens(PROMPT)
    return torch.cat([m(x[:, : m.in_features]) for m in _native(model).values() if m.in_features <= x.shape[1]], 1)


def _mapped_files(tensor: torch.Tensor) -> set[str]:
    """Files of this process's mappings that hold the tensor's first byte."""
    ptr, names = tensor.data_ptr(), set()
    for line in Path(f"/proc/{os.getpid()}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= ptr < high:
            names.add(fields[5] if len(fields) == 6 else "")
    return names


def _packed_files(model_dir: Path) -> list[str]:
    return sorted(p.name for p in model_dir.iterdir() if p.name.startswith(packed_cache.PREFIX))


def test_the_second_load_maps_the_first_loads_packing(model_dir: Path) -> None:
    first, _ = load_model(model_dir, torch.float32, "cpu", quantization="auto")
    files = _packed_files(model_dir)
    assert len(files) == 2 and {Path(f).suffix for f in files} == {".bin", ".json"}
    assert not any(packed_cache.PREFIX in name for m in _native(first).values() for name in _mapped_files(m.packed))
    second, _ = load_model(model_dir, torch.float32, "cpu", quantization="auto")
    assert _native(second).keys() == _native(first).keys() and _native(second)
    for name, module in _native(second).items():
        assert {str(model_dir / files[0])} == _mapped_files(module.packed), name
        for buffer in packed_cache.BUFFERS:
            assert torch.equal(getattr(module, buffer), getattr(_native(first)[name], buffer)), (name, buffer)
    assert second.embed_tokens.packed.data_ptr() == second.lm_head.packed.data_ptr()
    assert torch.equal(_outputs(first), _outputs(second))
    assert _packed_files(model_dir) == files


def test_a_changed_source_is_packed_again_and_the_old_files_go(model_dir: Path) -> None:
    load_model(model_dir, torch.float32, "cpu", quantization="auto")
    before = _packed_files(model_dir)
    source = model_dir / QUANTIZED_FILE
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    load_model(model_dir, torch.float32, "cpu", quantization="auto")
    after = _packed_files(model_dir)
    assert len(after) == 2 and not set(before) & set(after)


@pytest.mark.parametrize("damage", ["truncated", "offset outside", "other key"])
def test_a_file_that_does_not_match_its_index_is_not_used(model_dir: Path, damage: str, caplog) -> None:
    reference, _ = load_model(model_dir, torch.float32, "cpu", quantization="auto")
    packed_file, index_file = (model_dir / name for name in _packed_files(model_dir))
    index = json.loads(index_file.read_text())
    if damage == "truncated":
        os.truncate(packed_file, packed_file.stat().st_size // 2)
    elif damage == "offset outside":
        next(iter(index["modules"].values()))["scale"]["offset"] = index["nbytes"]
    else:
        index["key"]["mode"] = "int8"
    index_file.write_text(json.dumps(index))
    model, _ = load_model(model_dir, torch.float32, "cpu", quantization="auto")
    assert not any(packed_cache.PREFIX in name for m in _native(model).values() for name in _mapped_files(m.packed))
    assert torch.equal(_outputs(model), _outputs(reference))
    if damage != "other key":
        assert "packing the blocks again" in caplog.text


def test_a_directory_it_cannot_write_leaves_the_load_as_it_was(model_dir: Path, caplog) -> None:
    reference, _ = load_model(model_dir, torch.float32, "cpu", quantization="auto")
    for name in _packed_files(model_dir):
        (model_dir / name).unlink()
        (model_dir / name).mkdir()  # a directory where the file would go: the rename fails
    model, _ = load_model(model_dir, torch.float32, "cpu", quantization="auto")
    assert torch.equal(_outputs(model), _outputs(reference))
    assert "could not keep packed weights" in caplog.text
    assert not [p for p in model_dir.iterdir() if p.name.endswith(".tmp")]


def test_torch_kernels_neither_read_nor_write_it(model_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv(cpu_quant.KERNEL_ENV, "torch")
    model, _ = load_model(model_dir, torch.float32, "cpu", quantization="auto")
    assert not _native(model) and not _packed_files(model_dir)
