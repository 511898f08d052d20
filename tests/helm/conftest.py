"""The Helm chart's tests: a real helm (.venv/bin/helm, installed by `make` through
deploy/helm/install-helm.sh), KubeRay's RayService CRD (copied under kuberay/), Ray Serve's schema."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHART = ROOT / "deploy" / "helm" / "pdserve"


def _load_render_examples():
    spec = importlib.util.spec_from_file_location("pdserve_helm_render_examples", ROOT / "deploy/helm/render_examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render_examples = _load_render_examples()


@pytest.fixture(scope="session")
def promtool() -> str:
    """Debian's promtool, from `make ops-tools` (so its tests are in the slow tier: tests/conftest.py)."""
    found = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if found is None:
        pytest.fail("no promtool: run `make ops-tools` (Debian's prometheus package) or set PROMTOOL")
    return found


@pytest.fixture(scope="session")
def helm() -> str:
    found = render_examples.find_helm()
    if found is None:
        pytest.skip("no helm binary: run `bash deploy/helm/install-helm.sh .venv/bin` (make does) or set HELM")
    return found


@pytest.fixture(scope="session")
def render(helm):
    """render(values_files, sets) -> list of objects (None documents dropped)."""

    def _render(values: list[Path] = (), sets: list[str] = (), release: str = render_examples.RELEASE):
        text = render_examples.render(list(values), list(sets), helm=helm, release=release)
        return [doc for doc in yaml.safe_load_all(text) if doc]

    return _render


def _strip_kubernetes_extensions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_kubernetes_extensions(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if isinstance(node, list):
        return [_strip_kubernetes_extensions(v) for v in node]
    return node


@pytest.fixture(scope="session")
def rayservice_schema():
    """A validator for KubeRay v1.7.0's RayService openAPIV3Schema (x-kubernetes-* keys dropped)."""
    import jsonschema

    crd = yaml.safe_load((HERE / "kuberay" / "ray.io_rayservices.yaml").read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strip_kubernetes_extensions(v1["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def operator_rule_errors(rayservice: dict[str, Any]) -> list[str]:
    """The RayService rules the KubeRay operator checks in Go (the API server accepts such objects)."""
    errors = []
    name = rayservice["metadata"]["name"]
    if len(name) > 47:
        errors.append(f"name {name!r} longer than 47 characters")
    if not _DNS_1035.match(name):
        errors.append(f"name {name!r} is not DNS-1035")
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = cluster.get("workerGroupSpecs", [])
    names = [g["groupName"] for g in groups]
    if len(set(names)) != len(names):
        errors.append(f"groupName not unique: {names}")
    for g in groups:
        lo, n, hi = g.get("minReplicas", 0), g.get("replicas", 0), g.get("maxReplicas", 2**31 - 1)
        if not lo <= n <= hi:
            errors.append(f"{g['groupName']}: minReplicas {lo} <= replicas {n} <= maxReplicas {hi} fails")
    for spec in [cluster["headGroupSpec"], *groups]:
        params = spec.get("rayStartParams") or {}
        where = spec.get("groupName", "head")
        if spec.get("resources") and {"num-cpus", "num-gpus", "memory", "resources"} & params.keys():
            errors.append(f"{where}: rayStartParams num-cpus/num-gpus/memory/resources with top-level resources")
        if "labels" in params:
            errors.append(f"{where}: labels in rayStartParams")
    return errors


@pytest.fixture(scope="session")
def operator_rules():
    return operator_rule_errors
