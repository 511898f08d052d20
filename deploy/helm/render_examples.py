"""Golden rendered manifests: `helm template` of the chart for the default values and every
`ci/*-values.yaml`, written to `pdserve/examples/<name>.yaml`.

    python deploy/helm/render_examples.py          # regenerate
    python deploy/helm/render_examples.py --check  # exit 1 and name the stale files

helm: $HELM, else .venv/bin/helm (bash deploy/helm/install-helm.sh .venv/bin), else PATH.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

CHART = Path(__file__).resolve().parent / "pdserve"
ROOT = CHART.parents[2]
RELEASE, NAMESPACE = "pdserve", "pdserve"
# a generated Secret value differs on every render; goldens hold a placeholder
_GENERATED = re.compile(r"^(  redis-password: ).+$", re.M)


def find_helm() -> str | None:
    for candidate in (os.environ.get("HELM"), str(ROOT / ".venv" / "bin" / "helm"), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def render(values: list[Path] = (), sets: list[str] = (), helm: str | None = None, release: str = RELEASE) -> str:
    """`helm template`; raises CalledProcessError (stderr captured) when the chart refuses the values."""
    cmd = [helm or find_helm() or "helm", "template", release, str(CHART), "--namespace", NAMESPACE]
    for path in values:
        cmd += ["-f", str(path)]
    for item in sets:
        cmd += ["--set", item]
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def normalize(text: str) -> str:
    return _GENERATED.sub(r"\1<generated>", text)


def examples() -> dict[str, list[Path]]:
    """example name -> values files: `default` plus one per ci/<name>-values.yaml."""
    found = {"default": []}
    for path in sorted((CHART / "ci").glob("*-values.yaml")):
        found[path.name.removesuffix("-values.yaml")] = [path]
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    out_dir = CHART / "examples"
    stale = []
    for name, values in examples().items():
        text = normalize(render(values))
        target = out_dir / f"{name}.yaml"
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(str(target.relative_to(ROOT)))
        else:
            out_dir.mkdir(exist_ok=True)
            target.write_text(text)
    if stale:
        print("stale golden manifests (run python deploy/helm/render_examples.py):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
