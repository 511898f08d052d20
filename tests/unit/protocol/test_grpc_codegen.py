"""The committed gRPC modules are exactly what generate.proto compiles to, and import as pdserve.v1.*."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools")

from pdserve.v1 import codegen


def test_committed_modules_match_the_proto(tmp_path: Path):
    written = codegen.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(codegen.GENERATED)
    stale = [p.name for p in written
             if (codegen.PROTO.parent / p.name).read_bytes() != p.read_bytes()]
    assert not stale, (f"{stale} differ from what {codegen.PROTO.name} compiles to (or grpcio-tools "
                       "changed version): run `python -m pdserve.v1.codegen` and commit the result")


def test_generated_modules_import_by_package_path():
    grpc_module = (codegen.PROTO.parent / "generate_pb2_grpc.py").read_text()
    assert "from pdserve.v1 import generate_pb2" in grpc_module
    code = ("import sys; from pdserve.v1 import generate_pb2, generate_pb2_grpc, client; "
            "assert generate_pb2_grpc.add_GenerateServiceServicer_to_server; "
            "sys.exit(1 if {'torch', 'ray'} & set(sys.modules) else 0)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_request_presence_semantics():
    from pdserve.v1 import generate_pb2 as pb

    request = pb.GenerateRequest(model="tiny", text="hi", temperature=0.0, max_tokens=0)
    assert request.HasField("temperature") and request.HasField("max_tokens")
    assert not request.HasField("top_p") and not request.HasField("seed")
    assert request.WhichOneof("prompt") == "text"
