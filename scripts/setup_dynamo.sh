#!/usr/bin/env bash
# NVIDIA Dynamo's standalone KV indexer (ai-dynamo-runtime, `python -m dynamo.indexer`), the
# real router index that tests/e2e/test_router_dynamo.py feeds a vllm serve's KV events into:
# into its own virtualenv bin/dynamo-env, so its dependencies (pydantic, uvloop, ...) never
# move the versions vLLM runs on in .venv. Pinned; about 275 MB, 11 s from PyPI.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
BIN=${HELM_BIN_DIR:-bin}
DYNAMO_PIN=ai-dynamo-runtime==1.6.1

PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "setup_dynamo: $PY missing; run scripts/setup.sh first" >&2
  exit 1
fi
ENV_DIR="$BIN/dynamo-env"
if [ "$("$ENV_DIR/bin/python" -m pip show ai-dynamo-runtime 2>/dev/null | sed -n 's/^Version: //p')" != "${DYNAMO_PIN#*==}" ]; then
  echo "setup_dynamo: installing $DYNAMO_PIN into $ENV_DIR"
  rm -rf "$ENV_DIR"
  "$(readlink -f "$PY")" -m venv "$ENV_DIR"
  "$ENV_DIR/bin/python" -m pip install -q --upgrade pip
  "$ENV_DIR/bin/python" -m pip install -q "$DYNAMO_PIN"
fi
"$ENV_DIR/bin/python" -m dynamo.indexer --help >/dev/null
echo "setup_dynamo: ok ($DYNAMO_PIN)"
