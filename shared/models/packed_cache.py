"""The native kernel's packed weights, kept beside the model in one file that every replica maps.

Packing a GGUF file's blocks into the kernel's layout costs each replica about a second and leaves it a
private copy of every linear (98 MB for SmolLM2-135M). The first load writes the packed buffers to
`native-packed-<key>.bin` with a JSON index beside it; later loads map that file copy-on-write, so its pages
sit once in the page cache and every replica on the host shares them (a page is copied only if written,
which serving never does). <key> digests the layout version, the source file's size and mtime and the
modules packed: any change names other files, and the blocks are packed again. An index that does not
describe its file is not used. Nothing here is executed or unpickled: the index is JSON, the data raw bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from pdserve.models.gguf import QUANTIZED_FILE
from pdserve.models.quant_linear_native import NativeQuantLinear

logger = logging.getLogger(__name__)

LAYOUT_VERSION = 1
PREFIX = "native-packed-"
ALIGN = 64  # every buffer starts on a cache line
BUFFERS = ("packed", "scale", "offset")
DTYPES = {"uint8": torch.uint8, "float16": torch.float16, "float32": torch.float32}


def source_key(model_dir: Path, mode: str, modules: dict[str, int]) -> dict:
    """What a packed file must have been built from: the quantization mode, and each linear's bits."""
    stat = (model_dir / QUANTIZED_FILE).stat()
    return {"version": LAYOUT_VERSION, "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns,
            "mode": mode, "modules": dict(sorted(modules.items()))}


def paths(model_dir: Path, key: dict) -> tuple[Path, Path]:
    """The packed file made from `key` and its index."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return model_dir / f"{PREFIX}{digest}.bin", model_dir / f"{PREFIX}{digest}.json"


def load(model_dir: Path, key: dict) -> dict[str, NativeQuantLinear] | None:
    """The linears of the packed file made from `key`, over its mapped pages; None when there is none or it
    does not hold what its index says."""
    packed_file, index_file = paths(model_dir, key)
    try:
        index = json.loads(index_file.read_text())  # written after its file: present means complete
        if index.get("key") != key:
            return None
        data = np.memmap(packed_file, dtype=np.uint8, mode="c")  # copy-on-write: never the file
        if len(data) != index["nbytes"]:
            raise ValueError(f"{packed_file.name} holds {len(data)} bytes, its index says {index['nbytes']}")
        pages = torch.from_numpy(data)
        return {name: _module(pages, entry) for name, entry in index["modules"].items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:  # absent, truncated, malformed: pack again
        if not isinstance(exc, FileNotFoundError):
            logger.warning("packed weights in %s not used (%s); packing the blocks again", model_dir, exc)
        return None


def _module(pages: torch.Tensor, entry: dict) -> NativeQuantLinear:
    buffers = {}
    for name in BUFFERS:
        spec = entry[name]
        offset, shape, dtype = int(spec["offset"]), [int(d) for d in spec["shape"]], DTYPES[spec["dtype"]]
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if offset % ALIGN or offset < 0 or offset + nbytes > len(pages):
            raise ValueError(f"buffer {name} at {offset} ({nbytes} bytes) is outside the file")
        buffers[name] = pages[offset: offset + nbytes].view(dtype).view(shape)
    return NativeQuantLinear.from_packed(buffers["packed"], buffers["scale"], buffers["offset"], int(entry["bits"]),
                                         int(entry["in_features"]))


def save(model_dir: Path, key: dict, modules: dict[str, NativeQuantLinear]) -> None:
    """Writes the packed file, then its index (each to a temporary name, then renamed: replicas loading at
    the same moment see a whole file or none), and removes files made from other keys. A directory that
    cannot be written leaves the load as it is."""
    entries, chunks, at = {}, [], 0
    for name, module in modules.items():
        entry = {"bits": module.bits, "in_features": module.in_features}
        for buffer in BUFFERS:
            tensor = getattr(module, buffer).contiguous()
            raw = tensor.view(torch.uint8).reshape(-1).numpy()
            entry[buffer] = {"offset": at, "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
            pad = -len(raw) % ALIGN
            chunks += [raw, np.zeros(pad, np.uint8)]
            at += len(raw) + pad
        entries[name] = entry
    index = {"key": key, "nbytes": at, "modules": entries}
    packed_file, index_file = paths(model_dir, key)
    temporary = [path.with_name(f"{path.name}.{os.getpid()}.tmp") for path in (packed_file, index_file)]
    try:
        with open(temporary[0], "wb") as f:
            for chunk in chunks:
                f.write(chunk)  # numpy's buffer, not a copy
        os.replace(temporary[0], packed_file)
        temporary[1].write_text(json.dumps(index))
        os.replace(temporary[1], index_file)
        for old in model_dir.glob(f"{PREFIX}*"):  # a replica still mapping one keeps its pages until it exits
            if old not in (packed_file, index_file) and not old.name.endswith(".tmp"):
                old.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("could not keep packed weights in %s (%s); each load packs them", model_dir, exc)
        for path in temporary:
            path.unlink(missing_ok=True)
