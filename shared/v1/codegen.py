"""Regenerates generate_pb2.py / generate_pb2_grpc.py / generate_pb2.pyi from generate.proto.

`python -m pdserve.v1.codegen` rewrites the committed modules next to the proto; a unit test
regenerates into a temporary directory and compares, so a proto edit without regeneration fails.
Needs grpcio-tools (the test extra), which the generated modules themselves do not.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO = Path(__file__).with_name("generate.proto")
GENERATED = ("generate_pb2.py", "generate_pb2_grpc.py", "generate_pb2.pyi")


def generate(out_dir: str | Path) -> list[Path]:
    """Writes the generated modules into `out_dir` and returns their paths."""
    from grpc_tools import protoc

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # protoc derives the import path from the proto's path under the include root: laying it
        # out as pdserve/v1/ makes generate_pb2_grpc import `pdserve.v1.generate_pb2`
        src = Path(tmp, "src")
        (src / "pdserve" / "v1").mkdir(parents=True)
        proto = src / "pdserve" / "v1" / "generate.proto"
        shutil.copyfile(PROTO, proto)
        gen = Path(tmp, "gen")
        gen.mkdir()
        args = ["grpc_tools.protoc", f"-I{src}", f"--python_out={gen}", f"--pyi_out={gen}",
                f"--grpc_python_out={gen}", str(proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")
        written = []
        for name in GENERATED:
            target = out_dir / name
            shutil.copyfile(gen / "pdserve" / "v1" / name, target)
            written.append(target)
    return written


def main() -> int:
    for path in generate(PROTO.parent):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
