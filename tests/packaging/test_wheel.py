"""The built wheel must contain every package folder under shared/, services/ and loadtest/.

An unlisted subpackage imports fine in an editable install but is silently absent from the wheel.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _expected_packages() -> set[str]:
    expected = set()
    for folder, prefix in (("shared", "pdserve"), ("services", "pdserve.services"), ("loadtest", "pdserve.loadtest")):
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base).parts
            expected.add(".".join((prefix, *rel)))
    return expected


def test_wheel_contains_every_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("pdserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        inits = {n for n in zf.namelist() if n.endswith("/__init__.py")}
    built = {name.removesuffix("/__init__.py").replace("/", ".") for name in inits}
    missing = _expected_packages() - built
    assert not missing, f"packages missing from the wheel (add them to pyproject.toml): {sorted(missing)}"
    assert "pdserve.engine" in built and "pdserve.services" in built
