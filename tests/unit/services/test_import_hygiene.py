"""Dependency rules: the router's imports stay free of torch; pdserve.* never imports services."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_router_side_modules_do_not_import_torch():
    code = (
        "import sys; import pdserve.api.protocol, pdserve.models.tokenizer, pdserve.models.tiny, pdserve.sampling_params, "
        "pdserve.worklink, pdserve.api.contract; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_kvstore_and_serve_driver_do_not_import_torch():
    """The kvstore replica indexes blocks in Redis and never touches a tensor: torch would cost it ~130 MB of
    memory. `pdserve serve` itself checks a quantization in a child process, for the same reason, and binds
    the deployments without loading the engine (the replicas load it): ~190 MB and ~1.6 s of its start."""
    code = ("import sys; import pdserve.services.kvstore.app, pdserve.services.serve, pdserve.services.serve_checks; "
            "from pdserve.services.app import SystemConfig, build_system; build_system(SystemConfig()); "
            "build_system(SystemConfig(mode='colocated')); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_library_never_imports_services():
    """pdserve.* (shared/, and loadtest/ as pdserve.loadtest) is a client of the services, never their
    importer: the load tester deploys the system by its builder's import path, as a Serve config does."""
    offenders = [
        str(path.relative_to(ROOT)) for folder in ("shared", "loadtest") for path in (ROOT / folder).rglob("*.py")
        if "import pdserve.services" in path.read_text() or "from pdserve.services" in path.read_text()
    ]
    assert not offenders


def test_kvcache_sits_below_the_engine():
    """pdserve.kvcache (layout, pool, wire, transports, quantized storage) is what the engine stores its KV
    in; the handoff around an engine lives in pdserve.engine. An import back would make a cycle."""
    offenders = [str(path.relative_to(ROOT)) for path in (ROOT / "shared" / "kvcache").rglob("*.py")
                 if "pdserve.engine" in path.read_text()]
    assert not offenders
